#!/usr/bin/env bash
# Pretrain at pipeline size 4: scripts/pretrain_gpt.sh 4 (see its header for the environment variables).
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/pretrain_gpt.sh" 4 "$@"
