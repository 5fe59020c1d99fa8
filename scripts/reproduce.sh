#!/usr/bin/env bash
# Reproduce the TAH-Quant / AQ-SGD claims at small scale and regenerate docs/RESULTS.md.
#
#   bash scripts/reproduce.sh [PART] [extra args for python -m megatron_tah.reproduce]
#
# PART (default all). Expected durations on a 2-core machine (the times measured for the committed
# results are in docs/RESULTS.md, section "How to reproduce"):
#   data         tokenize Shakespeare (pretraining) and a State of the Union subset (fine-tuning)   ~1 min
#   convergence  pretraining per codec (7 runs) + fine-tuning per codec (6 runs), 2 at a time      ~60 min
#   ablations    TAH-Quant tau / INT4-INT3 mix / tile size / allocation (10 runs), 2 at a time     ~50 min
#   memory       AQ-SGD buffer bytes vs TAH-Quant (reads the fine-tuning runs)                      ~1 min
#   throughput   tokens/s per codec at 100M/1G/300M/500M/10Gbit + the paper regime (40 runs, one   ~25 min
#                at a time, real network namespaces: needs root and iproute2; first waits up to
#                15 min for a 1-minute load average < 3)
#   report       docs/RESULTS.md and docs/*.png from runs/reproduce/                              ~1 min
#   all          everything above, in that order                                                  ~2.5 h
# Split into parts to stay under an hour each. Results: runs/reproduce/<part>/; finished runs are
# skipped when a part is rerun (--force reruns them). Options go to python -m megatron_tah.reproduce
# (--jobs N, --max-load L, --max-wait S, --link emulate, --only NAMES, --docs DIR).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
PART=${1:-all}
shift || true

run_part() {
  echo "== reproduce: $1 (started $(date -u +%H:%M:%S) UTC)"
  "$PY" -m megatron_tah.reproduce "$@"
}

case "$PART" in
  data|convergence|ablations|seeds|long|memory|throughput|report)
    run_part "$PART" "$@"
    ;;
  all)
    for part in data convergence ablations seeds long memory throughput report; do
      run_part "$part" "$@"
    done
    ;;
  *)
    echo "usage: $0 [data|convergence|ablations|seeds|long|memory|throughput|report|all] [options]" >&2
    exit 2
    ;;
esac
