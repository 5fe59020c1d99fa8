"""The WAN ledger of pretraining runs (``python -m benchmarks.wan_bytes RUN_DIR``)."""
