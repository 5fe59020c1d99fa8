"""Ranks sharing a GPU: the device assignment, the mode's decision and its shims (fake device counts)."""

import logging
import types

import pytest
import torch

from megatron_tah.megatron import share_gpus
from megatron_tah.megatron.patching import Patches
from megatron_tah.megatron.share_gpus import ShareGpus, decide, device_for


@pytest.mark.parametrize("local_rank, count, device", [(0, 1, 0), (3, 1, 0), (3, 2, 1), (5, 4, 1), (2, 8, 2)])
def test_device_for_is_local_rank_mod_count(local_rank, count, device):
    assert device_for(local_rank, count) == device


@pytest.mark.parametrize("local_rank, count", [(-1, 1), (0, 0), (1.0, 1), (0, -2)])
def test_device_for_rejects_bad_input(local_rank, count):
    with pytest.raises(ValueError):
        device_for(local_rank, count)


@pytest.mark.parametrize("requested, ranks, count, on", [
    (False, 2, 2, False), (False, 4, 1, True), (True, 2, 2, True), (True, 4, 0, False), (False, 1, 0, False)])
def test_decide_and_its_one_log_line(caplog, requested, ranks, count, on):
    with caplog.at_level(logging.WARNING, logger=share_gpus.__name__):
        assert decide(requested, ranks, count) is on
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == (1 if on else 0)
    if on:
        assert f"{ranks} local ranks share {count} GPU(s)" in lines[0]
        assert ("--tah-share-gpus" if requested else f"{ranks} local ranks > {count} GPUs") in lines[0]


@pytest.mark.parametrize("backend, result", [("gloo", "gloo"), ("nccl", "gloo")])
def test_backend_in_shared_mode(backend, result):
    assert share_gpus.shared_backend(backend) == result


def test_other_backends_are_refused():
    with pytest.raises(ValueError, match="ucc.*gloo"):
        share_gpus.shared_backend("ucc")


def _fake_gpus(monkeypatch, count):
    calls = {"set_device": [], "init": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls["set_device"].append(d))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls["init"].append(kw))
    return calls


def _megatron_args(monkeypatch, local_rank, backend):
    from megatron.training import global_vars

    args = types.SimpleNamespace(local_rank=local_rank, distributed_backend=backend, rank=local_rank, world_size=4,
                                 distributed_timeout_minutes=1, fake_process_group=False, inprocess_restart=False,
                                 cuda_graph_impl="none", flight_recorder_dump_path=None)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    for var in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(var, raising=False)
    return args


@pytest.mark.parametrize("local_rank, count, device", [(3, 1, 0), (3, 2, 1)])
def test_shim_sets_the_shared_device_and_gloo(monkeypatch, local_rank, count, device):
    from megatron.training import initialize

    original = initialize._initialize_distributed
    calls = _fake_gpus(monkeypatch, count)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    args = _megatron_args(monkeypatch, local_rank, "nccl")
    patches = Patches()
    try:
        assert share_gpus.install(patches, ShareGpus(share_gpus=False))  # automatic: 4 ranks > count GPUs
        assert initialize._initialize_distributed is not original
        initialize._initialize_distributed(None, None, None, skip_model_parallel_init=True)
    finally:
        patches.restore()
    assert initialize._initialize_distributed is original
    assert calls["set_device"] == [device]
    assert calls["init"][0]["backend"] == "gloo"
    assert args.local_rank == local_rank  # restored after the call


def test_shim_is_not_applied_when_every_rank_has_a_gpu(monkeypatch):
    from megatron.training import initialize

    _fake_gpus(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    patches = Patches()
    assert not share_gpus.install(patches, ShareGpus())
    assert not patches
    original = initialize._initialize_distributed
    assert share_gpus.install(patches, ShareGpus(share_gpus=True))  # asked for: on
    share_gpus.install(patches, ShareGpus(share_gpus=True))  # twice: one wrapper
    patches.restore()
    assert initialize._initialize_distributed is original


def test_asking_without_cuda_is_a_clear_error(monkeypatch):
    _fake_gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        share_gpus.install(Patches(), ShareGpus(share_gpus=True))
    assert not share_gpus.install(Patches(), ShareGpus())  # CPU runs: off
