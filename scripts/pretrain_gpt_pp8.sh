#!/usr/bin/env bash
# Pretrain at pipeline size 8: scripts/pretrain_gpt.sh 8 (see its header for the environment variables).
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/pretrain_gpt.sh" 8 "$@"
