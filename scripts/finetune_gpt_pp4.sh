#!/usr/bin/env bash
# Finetune at pipeline size 4: scripts/finetune_gpt.sh 4 (see its header for the environment variables).
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/finetune_gpt.sh" 4 "$@"
