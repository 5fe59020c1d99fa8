"""Ranks sharing a GPU: the device assignment, the mode's decision and its shims (fake device counts)."""

import argparse
import logging
import types

import pytest
import torch

from megatron_tah.megatron import share_gpus
from megatron_tah.megatron.patching import Patches
from megatron_tah.megatron.share_gpus import decide, device_for


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


def _megatron_args(monkeypatch, local_rank, backend, **tah):
    from megatron.training import global_vars

    args = types.SimpleNamespace(**tah, local_rank=local_rank, distributed_backend=backend, rank=local_rank, world_size=4,
                                 distributed_timeout_minutes=1, fake_process_group=False, inprocess_restart=False,
                                 cuda_graph_impl="none", flight_recorder_dump_path=None)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    for var in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(var, raising=False)
    return args


def _initialize():
    """Megatron's ``_initialize_distributed`` (as looked up at call time) on fake devices and a fake group."""
    from megatron.training import initialize

    initialize._initialize_distributed(None, None, None, skip_model_parallel_init=True)


@pytest.mark.parametrize("requested, local_rank, count, device", [
    (False, 3, 1, 0), (False, 3, 2, 1), (True, 3, 4, 3), (True, 1, 2, 1)])
def test_shim_sets_the_shared_device_and_gloo_when_on(monkeypatch, requested, local_rank, count, device):
    """On when asked for (--tah-share-gpus, read from Megatron's parsed args at call time) or when the
    4 local ranks outnumber the GPUs: the shared device and gloo; local_rank restored afterwards."""
    from megatron.training import initialize

    original = initialize._initialize_distributed
    calls = _fake_gpus(monkeypatch, count)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    args = _megatron_args(monkeypatch, local_rank, "nccl", tah_share_gpus=requested)
    patches = Patches()
    try:
        share_gpus.install(patches)
        assert initialize._initialize_distributed is not original
        _initialize()
    finally:
        patches.restore()
    assert initialize._initialize_distributed is original
    assert calls["set_device"] == [device]
    assert calls["init"][0]["backend"] == "gloo"
    assert args.local_rank == local_rank  # restored after the call


def test_the_wrapper_leaves_megatron_alone_when_every_rank_has_a_gpu(monkeypatch, caplog):
    from megatron.training import initialize

    original = initialize._initialize_distributed
    calls = _fake_gpus(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _megatron_args(monkeypatch, 3, "nccl")  # no tah_share_gpus attribute (flags not added): off
    patches = Patches()
    share_gpus.install(patches)
    share_gpus.install(patches)  # twice: one wrapper
    assert initialize._initialize_distributed.__wrapped__ is original
    with caplog.at_level(logging.WARNING, logger=share_gpus.__name__):
        _initialize()
    patches.restore()
    assert initialize._initialize_distributed is original
    assert calls["set_device"] == [3] and calls["init"][0]["backend"] == "nccl" and not caplog.records


def test_asking_without_cuda_runs_on_the_cpu_and_says_so(monkeypatch, caplog):
    calls = _fake_gpus(monkeypatch, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _megatron_args(monkeypatch, 1, "gloo", tah_share_gpus=True)
    patches = Patches()
    share_gpus.install(patches)
    try:
        with caplog.at_level(logging.WARNING, logger=share_gpus.__name__):
            _initialize()
    finally:
        patches.restore()
    assert calls["set_device"] == [] and calls["init"][0]["backend"] == "gloo"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "without a CUDA device" in lines[0] and "staged" in lines[0]
    assert not share_gpus.enabled(False)  # CPU runs: off, silently


def test_the_mode_refuses_a_backend_other_than_gloo_or_nccl(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    _megatron_args(monkeypatch, 1, "ucc")
    patches = Patches()
    share_gpus.install(patches)
    try:
        with pytest.raises(ValueError, match="ucc.*gloo"):
            _initialize()
    finally:
        patches.restore()


def test_the_plugin_installs_the_wrapper_and_removes_it():
    from megatron.training import initialize

    from megatron_tah.megatron import plugin

    original = initialize._initialize_distributed
    plugin.install_megatron_lm_plugin()
    try:
        assert initialize._initialize_distributed.__wrapped__ is original
    finally:
        plugin.uninstall_megatron_lm_plugin()
    assert initialize._initialize_distributed is original


def test_tah_share_gpus_is_an_opt_in_flag():
    from megatron_tah.config import TahConfig
    from megatron_tah.megatron.arguments import add_tah_arguments

    parser = add_tah_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).tah_share_gpus is False and TahConfig().tah_share_gpus is False
    assert parser.parse_args(["--tah-share-gpus"]).tah_share_gpus is True
