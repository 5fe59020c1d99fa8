#!/usr/bin/env bash
# On a machine with a CUDA GPU, one command, no judgement needed:
#
#   scripts/gpu_check.sh                 # the self-check (~20 min on an H100, never more than 25 min)
#   scripts/gpu_check.sh benchmarks      # the measurements: bench, profile, report, pipeline, laaq (~40 min)
#   scripts/gpu_check.sh all             # both
#   scripts/gpu_check.sh sync            # or one step: a self-check step (kernels, graphs, sync, staging,
#                                        # sanitizer, share, interleaved, auto, laaq-layer, entropy) or a measurement
#                                        # (tests = kernels + graphs, bench, profile, report, pipeline, laaq)
#   PY=python3 OUT_DIR=/tmp/out scripts/gpu_check.sh bench
#
# The self-check (scripts/gpu_selfcheck.py: what each step checks, and how its 25 minutes were sized)
# prints PASS or FAIL per step and writes docs/benchmarks/<gpu>-selfcheck.{json,md}; each step runs under
# its own time limit, so a hang is a FAIL. The measurements write docs/benchmarks/<gpu>.json and .md
# (codec benchmark), <gpu>-profile-<shape>.json (where each call's time goes), <gpu>-kernel-report.json
# (the static report for comparison), <gpu>-pipeline.{md,json,png} (scripts/gpu_pipeline.sh: training at
# PP 2 and 4 sharing the GPU over slow links, ~15 min) and <gpu>-laaq.txt (LAAQ at PP=1 with and without
# selective recompute, ~5 min).
# Needs torch, triton, pytest and hypothesis; the training steps also megatron-core and the corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT_DIR=${OUT_DIR:-docs/benchmarks}
STEP=${1:-selfcheck}
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'EOF'
import torch, triton
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA device here")
print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
EOF
GPU=$("$PY" -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))')
mkdir -p "$OUT_DIR"
status=0

case $STEP in
    selfcheck|all) "$PY" scripts/gpu_selfcheck.py --out "$OUT_DIR" || status=$? ;;
    tests) "$PY" scripts/gpu_selfcheck.py --out "$OUT_DIR" --steps kernels,graphs || status=$? ;;
    kernels|graphs|sync|staging|sanitizer|share|interleaved|auto|entropy)
        "$PY" scripts/gpu_selfcheck.py --out "$OUT_DIR" --steps "$STEP" || status=$? ;;
    laaq-layer) "$PY" scripts/gpu_selfcheck.py --out "$OUT_DIR" --steps laaq || status=$? ;;
    benchmarks|bench|profile|report|pipeline|laaq) ;;
    *) echo "gpu_check: unknown step '$STEP' (selfcheck, benchmarks, all, or a step named above)" >&2; exit 2 ;;
esac
[[ $STEP == all ]] && STEP=benchmarks

if [[ $STEP == benchmarks || $STEP == bench ]]; then
    # [2048, 8, 8192] bf16 (the large shape), the demo's [64, 4, 128], GPT2-XL's [1024, 1, 1600].
    "$PY" scripts/bench_codecs.py --shapes 2048x8x8192 64x4x128 1024x1x1600 \
        --out "$OUT_DIR/$GPU.json" --markdown "$OUT_DIR/$GPU.md"
fi

if [[ $STEP == benchmarks || $STEP == profile ]]; then
    # Host vs device time per call, eager and replayed from a CUDA graph (codecs/core/graphs.py), at
    # GPT-2 XL's [1024, 1, 1600] (the host-cost goal: tah <= 60 us, lowrank encode <= 300 us) and the large shape.
    for shape in 1024x1x1600 2048x8x8192; do
        "$PY" scripts/profile_codecs.py --shape $shape --json "$OUT_DIR/$GPU-profile-$shape.json"
    done
fi

if [[ $STEP == benchmarks || $STEP == report ]]; then
    # The static numbers beside the measured ones (same Triton as the benchmark).
    "$PY" scripts/kernel_report.py --targets 90,80 --json "$OUT_DIR/$GPU-kernel-report.json"
fi

if [[ $STEP == benchmarks || $STEP == pipeline ]]; then
    # Issue 24's table: tokens/s of bf16, TAH-Quant, hadint4 and lowrank at 100 Mbit/s .. 10 Gbit/s.
    PY="$PY" OUT_DIR="$OUT_DIR" scripts/gpu_pipeline.sh
fi

if [[ $STEP == benchmarks || $STEP == laaq ]]; then
    # Issue 25's LAAQ goal configuration at PP=1: 8 local layers, hidden 1024, 16 heads, seq 1024, micro-batch 4,
    # bf16. Four runs: neither, LAAQ alone (attention's [b, heads, s, s] tensors kept), Megatron's selective
    # recompute alone, and both (the intended combination). Megatron's log gives the iteration time (the last
    # logged one of LAAQ_ITERS) and the peak allocated memory; the last lines compare each run with "none".
    rm -f "$OUT_DIR/$GPU-laaq.txt"
    for mode in none laaq selective laaq-selective; do
        dir="$OUT_DIR/$GPU-laaq-$mode"
        rm -rf "$dir" && mkdir -p "$dir"
        flags=(--tah-activation-memory none)
        [[ $mode == laaq* ]] && flags=(--tah-activation-memory laaq)
        [[ $mode == *selective ]] && flags+=(--recompute-granularity selective)
        if ! OUT="$dir/run" SAVE=none GPUS_PER_NODE=1 LAYERS=8 TRAIN_ITERS="${LAAQ_ITERS:-30}" \
                MICRO_BATCH=4 GLOBAL_BATCH=32 CODEC=none BWD_CODEC=none PYTHON="$PY" \
                bash scripts/pretrain_gpt.sh 1 --hidden-size 1024 --num-attention-heads 16 --transformer-impl local \
                "${flags[@]}" --log-interval 10 > "$dir/stdout.log" 2>&1; then
            echo "gpu_check: laaq $mode failed (last lines of $dir/stdout.log):" >&2
            tail -n 20 "$dir/stdout.log" >&2
            continue
        fi
        iter_ms=$(grep -o 'elapsed time per iteration (ms): [0-9.]*' "$dir/stdout.log" | tail -1 | awk '{print $NF}')
        peak_mb=$(grep -o 'max allocated: [0-9.]*' "$dir/stdout.log" | tail -1 | awk '{print $NF}')
        echo "laaq $mode: iteration ${iter_ms:-?} ms, peak allocated ${peak_mb:-?} MB" | tee -a "$OUT_DIR/$GPU-laaq.txt"
    done
    "$PY" - "$OUT_DIR/$GPU-laaq.txt" <<'EOF' | tee -a "$OUT_DIR/$GPU-laaq.txt"
import re, sys
runs = {m: (float(ms), float(mb)) for m, ms, mb in
        re.findall(r"laaq (\S+): iteration ([0-9.]+) ms, peak allocated ([0-9.]+) MB", open(sys.argv[1]).read())}
if "none" in runs:
    base_ms, base_mb = runs["none"]
    for mode, (ms, mb) in runs.items():
        print(f"laaq {mode} vs none: peak allocated {100 * (1 - mb / base_mb):.1f} % lower, iteration time "
              f"{100 * (ms / base_ms - 1):+.1f} % (goal for laaq-selective: >= 40 % lower at <= +10 %)")
EOF
fi
exit $status
