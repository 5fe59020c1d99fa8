#!/usr/bin/env bash
# Apply megatron_tah's hook to a Megatron-LM checkout (made for core_r0.19.0; applies to main too).
#
#   scripts/apply_patch.sh <Megatron-LM checkout> [patch file]
#
# First checks that the checkout's megatron-core has the pipeline transports and training functions
# the patch relies on (python -m megatron_tah.megatron.version), then `git apply --check`; changes
# nothing unless both pass. Exit status: 0 applied (or already applied), 1 unsupported megatron-core
# or the patch does not apply, 2 bad usage/checkout. PYTHON: the interpreter for the check.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
patch_file="${2:-$here/../patches/megatron-lm-core_r0.19.0.patch}"

if [[ $# -lt 1 || $# -gt 2 || "$1" == "-h" || "$1" == "--help" ]]; then
    echo "usage: $0 <Megatron-LM checkout> [patch file]" >&2
    exit 2
fi
checkout="$1"
if [[ ! -d "$checkout" ]]; then
    echo "apply_patch: error: $checkout is not a directory (expected a Megatron-LM checkout)" >&2
    exit 2
fi
if [[ ! -f "$checkout/pretrain_gpt.py" ]]; then
    echo "apply_patch: error: $checkout/pretrain_gpt.py not found: is $checkout a Megatron-LM checkout?" >&2
    exit 2
fi
if [[ ! -f "$patch_file" ]]; then
    echo "apply_patch: error: patch file $patch_file not found" >&2
    exit 2
fi
patch_file="$(cd "$(dirname "$patch_file")" && pwd)/$(basename "$patch_file")"
checkout="$(cd "$checkout" && pwd)"
# Never let git find a repository *around* the checkout: inside another repository, git apply would
# resolve paths against that repository's root and skip the checkout's files.
export GIT_CEILING_DIRECTORIES
GIT_CEILING_DIRECTORIES="$(dirname "$checkout")"

# Refuse, before touching anything, a megatron-core whose pipeline transports (or the training
# functions the plugin wraps) differ from what the patch relies on; the message names its version.
python_bin="${PYTHON:-}"
if [[ -z "$python_bin" ]]; then
    if [[ -x "$here/../.venv/bin/python" ]]; then python_bin="$here/../.venv/bin/python"; else python_bin=python3; fi
fi
if ! version="$(PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}" "$python_bin" -m megatron_tah.megatron.version "$checkout" 2>&1)"; then
    echo "apply_patch: error: ${version#error: }" >&2
    echo "  Nothing was changed." >&2
    exit 1
fi

# What the checkout is, for the messages (a plain directory works too).
revision="not a git checkout"
if git -C "$checkout" rev-parse --git-dir >/dev/null 2>&1; then
    revision="$(git -C "$checkout" describe --all --always 2>/dev/null || true) at $(git -C "$checkout" rev-parse --short HEAD 2>/dev/null || echo 'no commit')"
fi

if git -C "$checkout" apply --check --reverse "$patch_file" >/dev/null 2>&1; then
    echo "apply_patch: $(basename "$patch_file") is already applied to $checkout ($revision); nothing to do"
    exit 0
fi

if ! check_output="$(git -C "$checkout" apply --check "$patch_file" 2>&1)"; then
    {
        echo "apply_patch: error: $(basename "$patch_file") does NOT apply to $checkout ($revision)."
        echo "  It was made for Megatron-LM branch core_r0.19.0; nothing was changed. git apply --check says:"
        printf '%s\n' "$check_output" | sed 's/^/    /'
        echo "  Without the patch, run the unchanged script through the launcher instead:"
        echo "    python -m megatron_tah.launch $checkout/pretrain_gpt.py <megatron args> <--tah-* args>"
    } >&2
    exit 1
fi

git -C "$checkout" apply "$patch_file"
echo "apply_patch: applied $(basename "$patch_file") to $checkout ($revision, megatron-core $version)"
git -C "$checkout" apply --numstat "$patch_file" | awk '{printf "  %s: +%s -%s\n", $3, $1, $2}'
