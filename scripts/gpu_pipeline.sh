#!/usr/bin/env bash
# The pipeline throughput table on one GPU: GPT-2-XL-shaped stages (hidden 1600, 25 heads, seq 1024,
# micro-batch 1, bf16, LAYERS_PER_STAGE layers each) at PP 2 and 4 sharing the GPU
# (--tah-share-gpus), over links of 100 Mbit/s, 1 Gbit/s and 10 Gbit/s (tc in network namespaces
# when root with iproute2, else the in-process emulation; the table says which), for uncompressed
# bf16, the default TAH-Quant, --tah-preset hadint4 and --tah-preset lowrank. Then
# scripts/gpu_pipeline_table.py writes $OUT_DIR/<gpu>-pipeline.{md,json,png}.
#
# Budget: one GPU session has 30 minutes, so the runs are short: ITERS iterations (default 5, the
# first WARMUP = 2 not counted) of MICRO_BATCHES (8) micro-batches, no evaluation, no checkpoint.
# 24 runs + 1 calibration run (one stage alone, PP=1: the per-stage compute of the projection).
#
#   scripts/gpu_pipeline.sh                       # the whole table
#   PPS=2 RATES=100mbit CODECS="bf16 tah" scripts/gpu_pipeline.sh   # a part of it
#   EXTRA_ARGS="..." adds Megatron flags to every run; DRY_RUN=1 prints the commands only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-${PYTHON:-python3}}
OUT_DIR=${OUT_DIR:-docs/benchmarks}
RUN_DIR=${RUN_DIR:-runs/gpu_pipeline}
PPS=${PPS:-2 4}
RATES=${RATES:-100mbit 1gbit 10gbit}
CODECS=${CODECS:-bf16 tah hadint4 lowrank}
LAYERS_PER_STAGE=${LAYERS_PER_STAGE:-4}
MICRO_BATCHES=${MICRO_BATCHES:-8}
ITERS=${ITERS:-5}
WARMUP=${WARMUP:-2}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
read -r -a extra <<<"${EXTRA_ARGS:-}"
export PYTHON="$PY" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DEVICE=gpu SAVE=none
export MICRO_BATCH=1 GLOBAL_BATCH="$MICRO_BATCHES" TRAIN_ITERS="$ITERS" EVAL_INTERVAL=1000000 EVAL_ITERS=0
export LR=1.5e-4

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    GPU=dry-run
else
    GPU=$("$PY" -c 'import torch; assert torch.cuda.is_available(), "gpu_pipeline: no CUDA device"; print(torch.cuda.get_device_name())')
fi
if [[ "$(id -u)" == 0 ]] && command -v ip >/dev/null && command -v tc >/dev/null; then LINK=netns; else LINK=emulate; fi
export LINK
mkdir -p "$RUN_DIR" "$OUT_DIR"
echo "gpu_pipeline: $GPU, links by $LINK, $LAYERS_PER_STAGE layers per stage, $MICRO_BATCHES micro-batches, $ITERS iterations"

codec_args() {  # the --tah-* flags of a table row
    case "$1" in
        bf16) echo "none none" ;;
        tah) echo "tah fixedpoint" ;;
        hadint4|lowrank) echo "tah fixedpoint --tah-preset $1" ;;
        *) echo "gpu_pipeline: unknown codec $1 (bf16, tah, hadint4, lowrank)" >&2; exit 2 ;;
    esac
}

run() {  # run NAME PP RATE CODEC: one training run, its log and its meta record under $RUN_DIR/NAME
    local name=$1 pp=$2 rate=$3 codec=$4 dir="$RUN_DIR/$1"
    read -r fwd bwd preset <<<"$(codec_args "$codec")"
    local flags=()
    [[ -n "$preset" ]] && flags=($preset)
    rm -rf "$dir" && mkdir -p "$dir"
    printf '{"name": "%s", "pp": %d, "rate": "%s", "codec": "%s", "link": "%s", "gpu": "%s", "layers_per_stage": %d, "micro_batches": %d, "warmup": %d}\n' \
        "$name" "$pp" "$rate" "$codec" "$LINK" "$GPU" "$LAYERS_PER_STAGE" "$MICRO_BATCHES" "$WARMUP" > "$dir/meta.json"
    local env=(OUT="$dir" CODEC="$fwd" BWD_CODEC="$bwd" RATE="$rate" LAYERS=$((LAYERS_PER_STAGE * pp)))
    if (( pp > 1 )); then env+=(SHARE_GPUS=1); else env+=(GPUS_PER_NODE=1); fi
    echo "== $name"
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        env "${env[@]}" bash scripts/pretrain_gpt.sh "$pp" "${flags[@]}" "${extra[@]}"
        return
    fi
    if ! env "${env[@]}" timeout "$RUN_TIMEOUT" bash scripts/pretrain_gpt.sh "$pp" "${flags[@]}" "${extra[@]}" \
            > "$dir/stdout.log" 2>&1; then
        echo "gpu_pipeline: $name failed (last lines of $dir/stdout.log):" >&2
        tail -n 20 "$dir/stdout.log" >&2
    fi
}

run calib_pp1 1 "" bf16   # one stage alone on the GPU: its compute per iteration
for pp in $PPS; do
    for rate in $RATES; do
        for codec in $CODECS; do
            run "pp${pp}_${rate}_${codec}" "$pp" "$rate" "$codec"
        done
    done
done
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
"$PY" scripts/gpu_pipeline_table.py "$RUN_DIR" --out-dir "$OUT_DIR"
