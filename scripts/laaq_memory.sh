#!/usr/bin/env bash
# LAAQ's peak saved-tensor memory on CPU, PP=1, through Megatron-LM's loop (python -m megatron_tah.pretrain_gpt):
# LAAQ alone (attention's [b, heads, s, s] tensors kept) and LAAQ + --recompute-granularity selective (recomputed).
# The model keeps the goal configuration's ratio of attention to hidden tensors (heads * seq / hidden = 16: hidden
# 128, 4 heads, seq 512; the goal is hidden 1024, 16 heads, seq 1024), fp32 on CPU. Each run's --tah-log-json
# record gives the peak of what its layers saved, as it would be without LAAQ ("raw") and as stored.
#
#   scripts/laaq_memory.sh            # DATA_PREFIX (default data/shakespeare), OUT (default runs/laaq_memory)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DATA_PREFIX=${DATA_PREFIX:-data/shakespeare}
OUT=${OUT:-runs/laaq_memory}
mkdir -p "$OUT"
model=(--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 512 --max-position-embeddings 512
       --micro-batch-size 4 --global-batch-size 8 --train-iters 4 --lr 1e-3 --log-interval 1 --eval-interval 1000
       --eval-iters 1 --seed 1234 --transformer-impl local --distributed-backend gloo --no-gradient-accumulation-fusion
       --no-persist-layer-norm --tokenizer-type NullTokenizer --vocab-size 50257
       --train-data-path "${DATA_PREFIX}_train_text_document" --valid-data-path "${DATA_PREFIX}_valid_text_document")
for name in laaq laaq_selective; do
    extra=(--tah-activation-memory laaq)
    [[ $name == laaq_selective ]] && extra+=(--recompute-granularity selective)
    rm -f "$OUT/$name.jsonl"
    OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node 1 -m megatron_tah.pretrain_gpt "${model[@]}" --tah-log-json "$OUT/$name.jsonl" "${extra[@]}" \
        > "$OUT/$name.log" 2>&1 || { tail -n 20 "$OUT/$name.log" >&2; exit 1; }
done
"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
peaks = {}
for name in ("laaq", "laaq_selective"):
    records = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    peaks[name] = [r for r in records if "lm_loss" in r][-1]["saved_memory"]["0"]
base = peaks["laaq"]["raw_bytes"]  # neither LAAQ nor recomputation
print("| run | peak saved MB | vs neither |")
print("|---|---|---|")
rows = [("neither (LAAQ's raw count)", base), ("selective recompute only", peaks["laaq_selective"]["raw_bytes"]),
        ("LAAQ (attention kept)", peaks["laaq"]["stored_bytes"]),
        ("LAAQ + selective recompute", peaks["laaq_selective"]["stored_bytes"])]
for label, value in rows:
    print(f"| {label} | {value / 1e6:.2f} | {100 * (1 - value / base):.2f}% lower |")
PYEOF
