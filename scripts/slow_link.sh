#!/usr/bin/env bash
# Pipeline stages in network namespaces joined by tc-limited links (needs root and iproute2).
#   scripts/slow_link.sh --stages 4 --rate 100mbit -- python -m megatron_tah.pretrain_gpt <Megatron flags> ...
#   scripts/slow_link.sh measure --rate 300mbit [--transport gloo]
#   scripts/slow_link.sh cleanup
# Thin wrapper over `python -m megatron_tah.netns_link` (see its --help); PYTHON overrides the interpreter.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)"
exec "$python" -m megatron_tah.netns_link "$@"
