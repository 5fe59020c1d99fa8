#!/usr/bin/env bash
# Fine-tune a pretrained GPT with a compressed pipeline:  scripts/finetune_gpt.sh [PP] [extra flags...]
#
# Loads the weights of scripts/pretrain_gpt.sh's checkpoint (LOAD, default runs/pretrain_pp<PP>/ckpt)
# with Megatron's --finetune semantics (weights only; iteration count and optimizer start afresh) and
# trains on another corpus (CORPUS, default sotu: U.S. State of the Union addresses) at a lower
# learning rate, saving to runs/finetune_pp<PP>/ckpt. HF=<Hugging Face checkpoint folder> fine-tunes that model
# instead (imported once with python -m megatron_tah.hf_checkpoint import; see pretrain_gpt.sh). Every other variable
# (CODEC, BWD_CODEC, PRESET, RATE, LINK, EMBEDDINGS, MEGATRON_LM, GPUS_PER_NODE, NUM_NODES, DRY_RUN, ...) is
# pretrain_gpt.sh's, and so is a --tah-preset among the extra flags; see its header.
# EMBEDDINGS (untied by default when RATE is set) must match the pretraining run's checkpoint.
# AQ-SGD (CODEC=aqsgd) is meant for this task: samples are revisited every epoch.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/.."  # pretrain_gpt.sh runs from the repository root too: relative paths mean the same there
PP="${1:-${PP:-2}}"
[[ $# -gt 0 ]] && shift
export PP TASK=finetune FINETUNE="${FINETUNE:-1}"
export CORPUS="${CORPUS:-sotu}"
export LOAD="${LOAD:-runs/pretrain_pp${PP}/ckpt}"
if [[ -z "${HF:-}" && "${DRY_RUN:-0}" != 1 && ! -f "$LOAD/latest_checkpointed_iteration.txt" ]]; then
    echo "finetune_gpt: error: no pretraining checkpoint at $LOAD (run scripts/pretrain_gpt.sh $PP first, or set LOAD)" >&2
    exit 2
fi
exec "$here/pretrain_gpt.sh" "$PP" "$@"
