#!/usr/bin/env bash
# Finetune at pipeline size 8: scripts/finetune_gpt.sh 8 (see its header for the environment variables).
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/finetune_gpt.sh" 8 "$@"
