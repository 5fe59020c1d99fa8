#!/usr/bin/env bash
# Pretrain GPT with a compressed pipeline through Megatron-LM's training loop:
#   scripts/pretrain_gpt.sh [PP] [extra Megatron / --tah-* flags...]
#
# PP (argument or $PP, default 2): pipeline stages (2, 4 or 8 in the paper's setups).
# What runs: `python -m megatron_tah.pretrain_gpt` (megatron.training.pretrain with the plugin), or,
# with MEGATRON_LM=<Megatron-LM checkout>, that checkout's own pretrain_gpt.py through
# `python -m megatron_tah.launch` (its own megatron package, unchanged). Both on GPUs or on the CPU:
#   GPUs  one process per GPU (torchrun), GPT-2-XL-like ($LAYERS = 48 layers, hidden 1600, 25 heads,
#         seq 1024, bf16), Transformer Engine layers when `transformer_engine` imports, else local
#         layers; multi-node variables as in Megatron's examples: GPUS_PER_NODE (8), NUM_NODES (1),
#         NODE_RANK (0), MASTER_ADDR (localhost), MASTER_PORT (29500); GPUS_PER_NODE * NUM_NODES
#         must be a multiple of PP (the rest is data parallelism). SHARE_GPUS=1: one process per
#         stage on this node whatever its GPU count (--tah-share-gpus, local_rank % GPUs, gloo).
#         With RATE, GPU stages go into network namespaces behind tc exactly as CPU stages (LINK
#         auto/netns: one node, one process per stage, gloo), else the in-process emulation.
#   CPU   one process per stage over gloo, a CPU-sized GPT (4 layers or PP if more, hidden 128,
#         seq 64) with --transformer-impl local and the flags any run without Apex needs
#         (--no-gradient-accumulation-fusion --no-persist-layer-norm).
#
# Environment (all optional):
#   CODEC, BWD_CODEC   forward codec (tah | none | fixedpoint | fp8 | aqsgd; default tah) and backward
#                      codec (fixedpoint | none | tah | fp8; default fixedpoint, 6-bit as in the paper)
#   PRESET       a --tah-preset (e.g. channel_h4; docs/FLAGS.md lists them) in place of CODEC/BWD_CODEC's defaults;
#                a --tah-preset among the extra flags does the same
#   RATE         slow link between stages, e.g. 100mbit, 1gbit (default: none, the real network)
#   CHECKSUM     1: a checksum on every pipeline message's payload, checked on receipt (--tah-wire-checksum; a
#                corrupted message stops the run naming the link, and the restart loop resumes it); default 1
#                with RATE (on a slow link it costs under 0.05% of a step: docs/RELIABILITY.md), else 0
#   LINK         how to make RATE: auto (default: network namespaces + tc when root on CPU; else the
#                in-process emulation, --tah-emulate-bandwidth), netns, emulate
#   EMBEDDINGS   word embedding and output layer: untied (default when RATE is set:
#                --untie-embeddings-and-output-weights), tied (Megatron's default, the default without
#                RATE: every iteration all-reduces the vocabulary x hidden gradient between the first and
#                the last stage, uncompressed -- on a slow link more bytes than the whole pipeline), or
#                codec (tied, that all-reduce through --tah-embedding-codec int8). A fine-tuning run loads a
#                checkpoint of the same kind: set EMBEDDINGS as its pretraining had it. An imported model
#                (LOAD, HF) keeps its own (model); with RATE and tied embeddings, codec by default
#   DATA_PREFIX  tokenized corpus prefix (default data/$CORPUS; made with python -m megatron_tah.data)
#   CORPUS       corpus to tokenize when DATA_PREFIX is missing (default shakespeare)
#   TRAIN_ITERS, LR, MICRO_BATCH, GLOBAL_BATCH   training length and batch sizes
#   OUT          run directory (default runs/<task>_pp<PP>): ckpt/, tensorboard/, log.jsonl
#   SAVE, LOAD   checkpoint to write (default $OUT/ckpt; none: no checkpoint) / to start from; FINETUNE=1 loads its weights
#                only (Megatron's --finetune). A LOAD that `python -m megatron_tah.hf_checkpoint import` wrote brings
#                its model: its architecture flags replace the default model, and the corpus is tokenized with its
#                tokenizer (DATA_PREFIX default data/<corpus>_<folder name>); SEQ sets the sequence length (default
#                GPUs 1024, CPU 256)
#   HF           a Hugging Face checkpoint folder (Llama-, Mistral- or Qwen2-shaped; HF_GGUF names a GGUF file in it) to
#                start from: imported once into HF_CKPT (default runs/hf/<folder name>), then LOAD=HF_CKPT FINETUNE=1
#   RESTARTS     restart a failed run this many times (default 3; 0: never), each from the latest checkpoint
#                the run wrote to SAVE (--load SAVE), through `python -m megatron_tah.restart`, which prints the
#                error each failed attempt stopped on (the first a rank raised: the link, iteration and kind) and
#                the time lost; RESTART_DELAY seconds between attempts (default 5). No restart with SAVE=none.
#   SAVE_INTERVAL  iterations between checkpoints (default: GPUs 1000, CPU the whole run)
#   PYTHON       interpreter (default: .venv/bin/python if present, else python3)
#   DRY_RUN=1    print the command instead of running it (and do not tokenize)
#   DEVICE       gpu | cpu (default: gpu when torch sees CUDA); DRY_RUN=1 DEVICE=gpu prints a GPU command
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
CODEC_SET="${CODEC:-}"
BWD_CODEC_SET="${BWD_CODEC:-}"
CODEC="${CODEC:-tah}"
BWD_CODEC="${BWD_CODEC:-fixedpoint}"
PRESET="${PRESET:-}"
preset_given=0  # PRESET, or --tah-preset among the extra flags: the codec defaults would conflict with it
[[ -n "$PRESET" ]] && preset_given=1
for arg in "$@"; do [[ "$arg" == --tah-preset || "$arg" == --tah-preset=* ]] && preset_given=1; done
RATE="${RATE:-}"
LINK="${LINK:-auto}"
EMBEDDINGS_SET="${EMBEDDINGS:-}"
if [[ -n "$RATE" ]]; then EMBEDDINGS="${EMBEDDINGS:-untied}"; else EMBEDDINGS="${EMBEDDINGS:-tied}"; fi
if [[ -n "$RATE" ]]; then CHECKSUM="${CHECKSUM:-1}"; else CHECKSUM="${CHECKSUM:-0}"; fi
CORPUS="${CORPUS:-shakespeare}"
DATA_PREFIX_SET="${DATA_PREFIX:-}"
DATA_PREFIX="${DATA_PREFIX:-data/$CORPUS}"
OUT="${OUT:-runs/${TASK}_pp${PP}}"
SAVE="${SAVE:-$OUT/ckpt}"
LOAD="${LOAD:-}"
FINETUNE="${FINETUNE:-0}"
RESTARTS="${RESTARTS:-3}"
launch() {  # run "$@" (replacing this shell) under the restart loop, or print it with DRY_RUN=1
    local cmd=("$@")
    if [[ "$RESTARTS" != 0 && "$SAVE" != none ]]; then  # a failed run resumes from its checkpoint in $SAVE
        cmd=("$PYTHON" -m megatron_tah.restart --restarts "$RESTARTS" --delay-s "${RESTART_DELAY:-5}" --save "$SAVE"
             --log-json "$OUT/log.jsonl" -- "$@")
    fi
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%q ' "${cmd[@]}"
        echo
        exit 0
    fi
    set -x
    exec "${cmd[@]}"
}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
if [[ -n "${HF:-}" ]]; then  # a Hugging Face checkpoint: imported once, then fine-tuned from
    HF_CKPT="${HF_CKPT:-runs/hf/$(basename "$HF")}"
    if [[ ! -f "$HF_CKPT/megatron_flags.txt" && "${DRY_RUN:-0}" != 1 ]]; then
        echo "== importing $HF into $HF_CKPT"
        "$PYTHON" -m megatron_tah.hf_checkpoint import "$HF" "$HF_CKPT" ${HF_GGUF:+--gguf-file "$HF_GGUF"}
    fi
    LOAD="$HF_CKPT"
    FINETUNE=1
fi
imported=0  # LOAD is an imported model: its flags and tokenizer
if [[ -n "$LOAD" && ( -f "$LOAD/megatron_flags.txt" || -n "${HF:-}" ) ]]; then
    imported=1
    DATA_PREFIX="${DATA_PREFIX_SET:-data/${CORPUS}_$(basename "$LOAD")}"
fi

if [[ -n "${MEGATRON_LM:-}" ]]; then
    if [[ ! -f "$MEGATRON_LM/pretrain_gpt.py" ]]; then
        echo "pretrain_gpt: error: MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py" >&2
        exit 2
    fi
    script=(-m megatron_tah.launch "$MEGATRON_LM/pretrain_gpt.py")
else
    script=(-m megatron_tah.pretrain_gpt)
fi

tokenizer_args=()
[[ "$imported" == 1 ]] && tokenizer_args=(--tokenizer "$LOAD/tokenizer")
if [[ "${DRY_RUN:-0}" != 1 ]] && [[ ! -f "${DATA_PREFIX}_train_text_document.bin" || ! -f "${DATA_PREFIX}_valid_text_document.bin" ]]; then
    echo "== tokenizing $CORPUS into $DATA_PREFIX"
    "$PYTHON" -m megatron_tah.data --corpus "$CORPUS" --output-prefix "$DATA_PREFIX" "${tokenizer_args[@]}"
fi
data_args=(--train-data-path "${DATA_PREFIX}_train_text_document" --valid-data-path "${DATA_PREFIX}_valid_text_document")
# Pre-tokenized ids: Megatron's NullTokenizer, no tokenizer files or hub access at run time; GPT-2's vocabulary
# (<|endoftext|> = 50256 is its end-of-document token), or an imported model's (in its flags).
hf_model_args=()
if [[ "$imported" == 1 ]]; then
    if [[ "${DRY_RUN:-0}" == 1 && ! -f "$LOAD/megatron_flags.txt" ]]; then
        hf_model_args=("<the flags of $LOAD/megatron_flags.txt>")
    else
        read -ra hf_model_args <<< "$("$PYTHON" -m megatron_tah.hf_checkpoint flags "$LOAD" --pipeline "$PP")"
    fi
else
    data_args+=(--tokenizer-type NullTokenizer --vocab-size 50257)
fi
if [[ "$preset_given" == 1 ]]; then  # the preset's codecs, and only the codecs given explicitly
    tah_args=(${PRESET:+--tah-preset "$PRESET"} ${CODEC_SET:+--tah-forward-codec "$CODEC_SET"}
              ${BWD_CODEC_SET:+--tah-backward-codec "$BWD_CODEC_SET"})
else
    tah_args=(--tah-forward-codec "$CODEC" --tah-backward-codec "$BWD_CODEC")
fi
tah_args+=(--tah-log-json "$OUT/log.jsonl")
case "$CHECKSUM" in
    1) tah_args+=(--tah-wire-checksum) ;;
    0) ;;
    *) echo "pretrain_gpt: error: CHECKSUM=$CHECKSUM: choose 1 or 0" >&2; exit 2 ;;
esac
if [[ "$imported" == 1 ]]; then  # the model's own: tied unless its flags untie them
    model_ties=1
    [[ " ${hf_model_args[*]} " == *" --untie-embeddings-and-output-weights "* ]] && model_ties=0
    EMBEDDINGS="${EMBEDDINGS_SET:-model}"
    if [[ -z "$EMBEDDINGS_SET" && -n "$RATE" && "$model_ties" == 1 && "$PP" -ge 2 ]]; then
        EMBEDDINGS=codec  # its tied weights cannot be untied; their gradient exchange crosses the slow link
        echo "== the imported model ties its embeddings: behind RATE=$RATE their gradient exchange between the first" \
             "and the last stage goes through --tah-embedding-codec int8 (EMBEDDINGS=model: uncompressed)"
    fi
    if [[ "$EMBEDDINGS" == untied && "$model_ties" == 1 ]]; then
        echo "pretrain_gpt: error: EMBEDDINGS=untied: the imported model in $LOAD ties its embeddings" >&2
        exit 2
    fi
    [[ "$EMBEDDINGS" == untied ]] && EMBEDDINGS=model  # already in its flags
fi
case "$EMBEDDINGS" in
    tied|model) ;;
    untied) tah_args+=(--untie-embeddings-and-output-weights) ;;
    codec) [[ "$PP" -ge 2 ]] && tah_args+=(--tah-embedding-codec int8) ;;  # one stage: nothing crosses
    *) echo "pretrain_gpt: error: EMBEDDINGS=$EMBEDDINGS: choose untied, tied or codec" >&2; exit 2 ;;
esac
ckpt_args=(--save "$SAVE" --tensorboard-dir "$OUT/tensorboard")
[[ "$SAVE" == none ]] && ckpt_args=(--tensorboard-dir "$OUT/tensorboard")  # SAVE=none: no checkpoint
if [[ -n "$LOAD" ]]; then
    ckpt_args+=(--load "$LOAD")
    [[ "$FINETUNE" == 1 ]] && ckpt_args+=(--finetune)
fi

netns_ok() {  # LINK=netns, or LINK=auto with root, ip and tc: stages in namespaces behind tc
    case "$LINK" in
        netns) return 0 ;;
        auto) [[ "$(id -u)" == 0 ]] && command -v ip >/dev/null && command -v tc >/dev/null ;;
        emulate) return 1 ;;
        *) echo "pretrain_gpt: error: LINK=$LINK: choose auto, netns or emulate" >&2; exit 2 ;;
    esac
}
if [[ -z "${DEVICE:-}" ]]; then
    DEVICE=cpu
    if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then DEVICE=gpu; fi
fi
if [[ "$DEVICE" == gpu ]]; then
    # ---- GPUs: GPT-2-XL-like, one process per GPU (per stage with SHARE_GPUS=1).
    LAYERS="${LAYERS:-48}"
    share_args=()
    if [[ "${SHARE_GPUS:-0}" == 1 ]]; then
        GPUS_PER_NODE="$PP"
        share_args=(--tah-share-gpus --distributed-backend gloo)
    fi
    GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
    NUM_NODES="${NUM_NODES:-1}"
    NODE_RANK="${NODE_RANK:-0}"
    MASTER_ADDR="${MASTER_ADDR:-localhost}"
    MASTER_PORT="${MASTER_PORT:-29500}"
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES))
    if (( (imported == 0 && LAYERS % PP != 0) || WORLD_SIZE % PP != 0 )); then
        echo "pretrain_gpt: error: PP=$PP must divide $LAYERS layers and the $WORLD_SIZE GPUs" >&2
        exit 2
    fi
    impl=(--transformer-impl local)
    if "$PYTHON" -c 'import transformer_engine' >/dev/null 2>&1; then impl=(--transformer-impl transformer_engine); fi
    if ! "$PYTHON" -c 'import fused_weight_gradient_mlp_cuda' >/dev/null 2>&1; then
        impl+=(--no-gradient-accumulation-fusion)  # Apex's fused wgrad kernel is missing
    fi
    if ! "$PYTHON" -c 'import apex' >/dev/null 2>&1; then impl+=(--no-persist-layer-norm); fi
    if [[ ${impl[1]} == local ]] && ! "$PYTHON" -c 'import scaled_masked_softmax_cuda' >/dev/null 2>&1; then
        # Megatron's fused softmax imports this CUDA extension for bf16 (megatron/core/fusions/fused_softmax.py)
        impl+=(--no-masked-softmax-fusion)
    fi
    gpu_netns=0
    if [[ -n "$RATE" && "$PP" -ge 2 ]] && netns_ok; then
        if (( NUM_NODES != 1 || GPUS_PER_NODE != PP )); then
            echo "pretrain_gpt: error: GPU stages in namespaces need one node and one process per stage" \
                 "(GPUS_PER_NODE=PP or SHARE_GPUS=1); LINK=emulate for the in-process emulation" >&2
            exit 2
        fi
        gpu_netns=1
        [[ ${#share_args[@]} -gt 0 ]] || share_args=(--distributed-backend gloo)  # traffic through eth0
    elif [[ -n "$RATE" ]]; then
        tah_args+=(--tah-emulate-bandwidth "$RATE")
    fi
    model_args=(--num-layers "$LAYERS" --hidden-size 1600 --num-attention-heads 25 --seq-length 1024
                --max-position-embeddings 1024 --position-embedding-type learned_absolute
                --attention-dropout 0.1 --hidden-dropout 0.1 --init-method-std 0.02 --bf16)
    [[ "$imported" == 1 ]] && model_args=("${hf_model_args[@]}" --seq-length "${SEQ:-1024}" --bf16)
    if [[ "$TASK" == finetune ]]; then def_iters=2000; def_lr=2e-5; else def_iters=20000; def_lr=1.5e-4; fi
    train_args=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size "$PP"
                --micro-batch-size "${MICRO_BATCH:-1}" --global-batch-size "${GLOBAL_BATCH:-64}"
                --train-iters "${TRAIN_ITERS:-$def_iters}" --lr "${LR:-$def_lr}" --min-lr 1e-5
                --lr-decay-style cosine --lr-warmup-fraction 0.01 --weight-decay 0.1 --clip-grad 1.0
                --adam-beta1 0.9 --adam-beta2 0.95)
    log_args=(--log-interval 1 --eval-interval "${EVAL_INTERVAL:-200}" --eval-iters "${EVAL_ITERS:-10}"
              --save-interval "${SAVE_INTERVAL:-1000}" --log-throughput)
    gpu_args=("${script[@]}" "${model_args[@]}" "${impl[@]}" "${train_args[@]}" "${data_args[@]}" "${log_args[@]}"
              "${ckpt_args[@]}" "${tah_args[@]}" "${share_args[@]}" "$@")
    if [[ "$gpu_netns" == 1 ]]; then
        [[ "${DRY_RUN:-0}" == 1 ]] || mkdir -p "$OUT"
        echo "== $PP GPU stages in network namespaces, links limited to $RATE by tc"
        launch "$PYTHON" -m megatron_tah.netns_link --stages "$PP" --rate "$RATE" -- "$PYTHON" "${gpu_args[@]}"
    fi
    launch "$PYTHON" -m torch.distributed.run --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" \
        --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "${gpu_args[@]}"
fi

# ---- CPU: a CPU-sized GPT, one process per stage over gloo.
if [[ "$TASK" == finetune ]]; then def_iters=40; def_lr=3e-4; else def_iters=200; def_lr=1e-3; fi
iters="${TRAIN_ITERS:-$def_iters}"
cpu_model_args=(--num-layers "$((PP > 4 ? PP : 4))" --hidden-size 128 --num-attention-heads 4 --seq-length 64
                --max-position-embeddings 64)
[[ "$imported" == 1 ]] && cpu_model_args=("${hf_model_args[@]}" --seq-length "${SEQ:-256}" --bf16)
megatron_args=(--pipeline-model-parallel-size "$PP" "${cpu_model_args[@]}"
               --micro-batch-size "${MICRO_BATCH:-4}" --global-batch-size "${GLOBAL_BATCH:-16}"
               --train-iters "$iters" --lr "${LR:-$def_lr}" --lr-warmup-iters "$(( iters / 10 < 10 ? iters / 10 : 10 ))" --lr-decay-style cosine
               --weight-decay 0.01 --clip-grad 1.0 --eval-interval 50 --eval-iters 4 --log-interval 10
               --save-interval "${SAVE_INTERVAL:-$iters}" --transformer-impl local --distributed-backend gloo
               --no-gradient-accumulation-fusion --no-persist-layer-norm "${data_args[@]}" "${ckpt_args[@]}" "${tah_args[@]}" "$@")
[[ "${DRY_RUN:-0}" == 1 ]] || mkdir -p "$OUT"
use_netns=0
if [[ -n "$RATE" && "$PP" -ge 2 ]] && netns_ok; then use_netns=1; fi
if [[ "$use_netns" == 1 ]]; then
    # One stage per network namespace; netns_link sets RANK/WORLD_SIZE/MASTER_ADDR for each.
    echo "== $PP stages in network namespaces, links limited to $RATE by tc"
    launch "$PYTHON" -m megatron_tah.netns_link --stages "$PP" --rate "$RATE" -- "$PYTHON" "${script[@]}" "${megatron_args[@]}"
fi
if [[ -n "$RATE" ]]; then
    echo "== in-process link emulation at $RATE (LINK=emulate, or no root/ip/tc for namespaces)"
    megatron_args+=(--tah-emulate-bandwidth "$RATE")
fi
launch "$PYTHON" -m torch.distributed.run --nproc-per-node "$PP" --master-port "${MASTER_PORT:-29500}" \
    "${script[@]}" "${megatron_args[@]}"
