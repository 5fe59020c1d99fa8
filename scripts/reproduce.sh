#!/usr/bin/env bash
# Reproduce the TAH-Quant / AQ-SGD claims at small scale and regenerate docs/RESULTS.md.
#
#   bash scripts/reproduce.sh PART [extra args for python -m benchmarks.reproduce]
#   make reproduce PART=NAME [ARGS="..."]
#
# PART is required: without one the script prints this list and exits (status 2), so that nobody starts
# the ~10 h `all` by accident. Durations on a 2-core machine, estimated from the run times measured for the
# committed results (training runs two at a time; docs/RESULTS.md, "How to reproduce", lists them):
#   data         tokenize Shakespeare (pretraining) and a State of the Union subset (fine-tuning)   ~1 min
#   convergence  pretraining per codec (6 runs) + fine-tuning per codec (6 runs), 2 at a time      ~25 min
#   ablations    TAH-Quant tau / mix / tile / allocation / rounding; MXFP4, NVFP4 (15 runs)       ~45 min
#   seeds        pretraining + fine-tuning of none, tah, direct 4/3-bit with 2 more seeds (16 runs) ~35 min
#   long         pretraining of none, tah, direct 3-bit for 800 iterations (3 runs)               ~30 min
#   parity       the parity study: candidate codecs x seeds 1234-1236 at hidden 128 (reuses the
#                convergence/seeds runs) and 256 (45 runs, 38 new; 7-15 min each, 2 at a time)  ~3.8 h
#   parity-seeds none, TAH-Quant and the hadint4 preset with seeds 1237-1239 at both widths      ~1.6 h
#                (18 runs; narrows the parity study's intervals; --seeds 1240,1241 --widths 128 and
#                --only NAMES pick other seeds, widths and runs)
#   parity-compact the low-noise protocol (4096-id vocabulary, 16 sequences x 300 iterations):   ~3.6 h
#                none, TAH-Quant (6-bit and INT4 bwd), hadint4 and lowrank presets, lowrank rank 8,
#                8-bit control x seeds 1234-1236 x hidden 128/256, plus 2 backward codecs with every
#                seed and 8 diagnostics with seed 1234 at hidden 128
#                (56 runs, 5-13 min each, 2 at a time; --seeds / --widths as for parity-seeds)
#   memory       AQ-SGD buffer bytes vs TAH-Quant (reads the fine-tuning runs)                      ~1 min
#   throughput   tokens/s per codec at 100M/1G/300M/500M/10Gbit + the paper regime (40 runs, one   ~20 min
#                at a time, real network namespaces: needs root and iproute2; first waits up to
#                15 min for a 1-minute load average < 3)
#   report       docs/RESULTS.md and docs/data/*.png from runs/reproduce/                         ~1 min
#   parity-report docs/PARITY.md: the parity study alone, from docs/data/parity_runs.json (the       ~1 min
#                committed record of every parity run, refreshed from the logs here; seeds add up across
#                machines)
#   all          everything above, in that order (seeds needs convergence's checkpoint)          ~10 h
# Split into parts to stay under an hour each (parity: --only NAMES runs a subset). Results:
# runs/reproduce/<part>/; finished runs are skipped when a part is rerun (--force reruns them). Options go to python -m benchmarks.reproduce
# (--jobs N, --max-load L, --max-wait S, --link emulate, --only NAMES, --seeds S,S --widths W,W, --docs DIR).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
PART=${1:-}
shift || true

usage() {
  echo "usage: $0 [data|convergence|ablations|seeds|long|parity|parity-seeds|parity-compact|memory|throughput|report|parity-report|all] [options]" >&2
  sed -n '/^# PART is required/,/^# Split into parts/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
}

if [[ -z $PART ]]; then
  echo "reproduce: no PART given. 'all' runs every part below, about 10 hours on a 2-core machine;" >&2
  echo "reproduce: name one part (or 'all' to really run everything)." >&2
  usage
  exit 2
fi

run_part() {
  echo "== reproduce: $1 (started $(date -u +%H:%M:%S) UTC)"
  "$PY" -m benchmarks.reproduce "$@"
}

case "$PART" in
  data|convergence|ablations|seeds|long|parity|parity-seeds|parity-compact|memory|throughput|report|parity-report)
    run_part "$PART" "$@"
    ;;
  all)
    for part in data convergence ablations seeds long parity parity-seeds parity-compact memory throughput parity-report report; do
      run_part "$part" "$@"
    done
    ;;
  *)
    echo "reproduce: unknown part '$PART'" >&2
    usage
    exit 2
    ;;
esac
