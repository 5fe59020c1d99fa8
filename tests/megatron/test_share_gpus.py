"""Ranks sharing a GPU: the device assignment, the decision from device identities and the shims (fake GPUs)."""

import argparse
import logging
import types
from pathlib import Path

import pytest
import torch

from megatron_tah.megatron import share_gpus
from megatron_tah.megatron.patching import Patches
from megatron_tah.megatron.share_gpus import device_for


@pytest.mark.parametrize("local_rank, count, device", [(0, 1, 0), (3, 1, 0), (3, 2, 1), (5, 4, 1), (2, 8, 2)])
def test_device_for_is_local_rank_mod_count(local_rank, count, device):
    assert device_for(local_rank, count) == device


@pytest.mark.parametrize("local_rank, count", [(-1, 1), (0, 0), (1.0, 1), (0, -2)])
def test_device_for_rejects_bad_input(local_rank, count):
    with pytest.raises(ValueError):
        device_for(local_rank, count)


@pytest.mark.parametrize("identities, pair", [
    (["GPU-a", "GPU-b", "GPU-c", "GPU-d"], None),  # one GPU each (CUDA_VISIBLE_DEVICES per rank: each sees "0")
    (["GPU-a", "GPU-a", "GPU-a", "GPU-a"], (0, 1, "GPU-a")),
    (["GPU-a", "GPU-b", "GPU-c", "GPU-b"], (1, 3, "GPU-b")),
    (["GPU-a"], None)])
def test_sharing_is_decided_by_device_identities(identities, pair):
    assert share_gpus.sharing(identities) == pair


def test_identities_are_exchanged_through_the_store_by_every_rank():
    import threading

    store = torch.distributed.HashStore()
    names = ["GPU-x", "GPU-y", "GPU-x"]
    results = [None] * 3

    def rank(r):
        results[r] = share_gpus.exchange_identities(store, r, 3, names[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [names] * 3


@pytest.mark.parametrize("backend, result", [("gloo", "gloo"), ("nccl", "gloo")])
def test_backend_in_shared_mode(backend, result):
    assert share_gpus.shared_backend(backend) == result


def test_other_backends_are_refused():
    with pytest.raises(ValueError, match="ucc.*gloo"):
        share_gpus.shared_backend("ucc")


def _fake_gpus(monkeypatch, count, others=None, mine=None):
    """``count`` visible fake GPUs (UUID ``GPU-<index>`` unless ``mine`` names this rank's) and a rendezvous store
    holding ``others``: ``{rank: identity}`` of the other ranks, as they would have set them."""
    from megatron.training import initialize

    calls = {"set_device": [], "init": [], "rendezvous": 0}
    # Megatron's initialize sees torch itself: CPU shims an earlier test of this process left on replace its torch
    monkeypatch.setattr(initialize, "torch", torch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls["set_device"].append(d))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(uuid=mine if mine is not None else f"GPU-{d}"))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls["init"].append(kw))
    store = torch.distributed.HashStore()
    for rank, identity in (others or {}).items():
        torch.distributed.PrefixStore("default_pg", store).set(share_gpus.IDENTITY_KEY.format(rank=rank), identity)

    def rendezvous(url, rank, world_size, timeout=None):
        assert url == "env://"
        calls["rendezvous"] += 1
        yield store, rank, world_size

    monkeypatch.setattr(torch.distributed, "rendezvous", rendezvous)
    return calls


def _megatron_args(monkeypatch, local_rank, backend, pipeline=None, **tah):
    from megatron.training import global_vars

    args = types.SimpleNamespace(**tah, local_rank=local_rank, distributed_backend=backend, rank=local_rank, world_size=4,
                                 distributed_timeout_minutes=1, fake_process_group=False, inprocess_restart=False,
                                 cuda_graph_impl="none", flight_recorder_dump_path=None,
                                 pipeline_model_parallel_comm_backend=pipeline)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    for var in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(var, raising=False)
    return args


def _initialize():
    """Megatron's ``_initialize_distributed`` (as looked up at call time) on fake devices and a fake group."""
    from megatron.training import initialize

    initialize._initialize_distributed(None, None, None, skip_model_parallel_init=True)


def _run_wrapped(monkeypatch, caplog=None):
    """Megatron's ``_initialize_distributed`` through the wrapper; its log lines; the wrapper removed after."""
    from megatron.training import initialize

    original = initialize._initialize_distributed
    patches = Patches()
    try:
        share_gpus.install(patches)
        share_gpus.install(patches)  # twice: one wrapper
        assert initialize._initialize_distributed.__wrapped__ is original
        with caplog.at_level(logging.WARNING, logger=share_gpus.__name__) if caplog else _nothing():
            _initialize()
    finally:
        patches.restore()
    assert initialize._initialize_distributed is original
    return [r.getMessage() for r in caplog.records] if caplog else []


class _nothing:
    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


# Rank 3 of 4 local ranks; the other ranks' devices as they put them in the store.
SAME_GPU = {0: "GPU-0", 1: "GPU-0", 2: "GPU-0"}
OWN_GPUS = {0: "GPU-a", 1: "GPU-b", 2: "GPU-c"}


@pytest.mark.parametrize("requested, count, others, device", [
    (False, 1, SAME_GPU, 0),  # 4 ranks, 1 GPU: every rank on GPU-0
    (False, 2, {0: "GPU-0", 1: "GPU-1", 2: "GPU-0"}, 1),  # 4 ranks, 2 GPUs
    (True, 4, None, 3),  # asked for: no exchange
    (True, 2, None, 1)])
def test_shim_sets_the_shared_device_and_gloo_when_on(monkeypatch, requested, count, others, device):
    """On when asked for (--tah-share-gpus, read from Megatron's parsed args at call time) or when two ranks'
    devices are one GPU: the shared device and gloo; local_rank restored afterwards; one rendezvous."""
    calls = _fake_gpus(monkeypatch, count, others)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    args = _megatron_args(monkeypatch, 3, "nccl", tah_share_gpus=requested)
    _run_wrapped(monkeypatch)
    assert calls["set_device"] == [device]
    assert calls["init"][0]["backend"] == "gloo"
    assert args.local_rank == 3  # restored after the call
    assert calls["rendezvous"] == (0 if requested else 1)
    if not requested:  # the store the identities went through is the one the world is made with
        assert calls["init"][0]["store"].get(share_gpus.IDENTITY_KEY.format(rank=3)) == f"GPU-{device}".encode()


def test_ranks_given_one_gpu_each_keep_nccl_and_get_device_0(monkeypatch, caplog):
    """CUDA_VISIBLE_DEVICES per rank: each of the 4 local ranks sees one device, 0, but they are four GPUs.
    Counting devices (1 < 4 local ranks) would switch them all to gloo; their UUIDs say nothing is shared."""
    calls = _fake_gpus(monkeypatch, 1, OWN_GPUS, mine="GPU-d")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    args = _megatron_args(monkeypatch, 3, "nccl", pipeline="nccl")
    lines = _run_wrapped(monkeypatch, caplog)
    assert calls["set_device"] == [0] and calls["init"][0]["backend"] == "nccl"
    assert args.pipeline_model_parallel_comm_backend == "nccl" and args.local_rank == 3
    assert len(lines) == 1 and "every rank has its own GPU (3), backend unchanged" in lines[0], lines


def test_the_wrapper_leaves_megatron_alone_when_every_rank_has_a_gpu(monkeypatch, caplog):
    calls = _fake_gpus(monkeypatch, 4, {0: "GPU-0", 1: "GPU-1", 2: "GPU-2"})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _megatron_args(monkeypatch, 3, "nccl")  # no tah_share_gpus attribute (flags not added): off
    lines = _run_wrapped(monkeypatch, caplog)
    assert calls["set_device"] == [3] and calls["init"][0]["backend"] == "nccl" and not lines


def test_the_shared_mode_drops_an_nccl_pipeline_backend_and_says_which_ranks_share(monkeypatch, caplog):
    """--pipeline-model-parallel-comm-backend nccl would build an NCCL pipeline group on the shared GPU."""
    _fake_gpus(monkeypatch, 1, SAME_GPU)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    args = _megatron_args(monkeypatch, 3, "nccl", pipeline="nccl")
    lines = _run_wrapped(monkeypatch, caplog)
    assert args.distributed_backend == "gloo" and args.pipeline_model_parallel_comm_backend is None
    assert "ranks 0 and 1 are both on GPU GPU-0" in lines[0]
    assert any("--pipeline-model-parallel-comm-backend nccl dropped" in line for line in lines), lines


@pytest.mark.parametrize("backend, pipeline, match", [
    ("ucc", None, "--distributed-backend ucc.*gloo"),
    ("nccl", "ucc", "--pipeline-model-parallel-comm-backend ucc.*gloo")])
def test_the_mode_refuses_backends_other_than_gloo_or_nccl(monkeypatch, backend, pipeline, match):
    _fake_gpus(monkeypatch, 1, SAME_GPU)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _megatron_args(monkeypatch, 3, backend, pipeline=pipeline)
    with pytest.raises(ValueError, match=match):
        _run_wrapped(monkeypatch)


def test_variable_sequence_lengths_are_refused_in_the_mode_and_the_refusal_removed_with_the_wrapper(monkeypatch):
    """megatron-core sends variable shapes as CUDA tensors over the (gloo) pipeline group itself."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    original = P2PCommunicator.__dict__["_communicate_shapes"]
    _fake_gpus(monkeypatch, 1, SAME_GPU)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _megatron_args(monkeypatch, 3, "nccl")
    from megatron.training import initialize

    patches = Patches()
    share_gpus.install(patches)
    try:
        _initialize()
        with pytest.raises(RuntimeError, match="cannot exchange variable sequence lengths.*gloo"):
            P2PCommunicator._communicate_shapes(object(), None, None, True, False)
    finally:
        patches.restore()
    assert P2PCommunicator.__dict__["_communicate_shapes"] is original
    assert not hasattr(initialize._initialize_distributed, "__wrapped__")


def test_asking_without_cuda_runs_on_the_cpu_and_says_so(monkeypatch, caplog):
    calls = _fake_gpus(monkeypatch, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _megatron_args(monkeypatch, 1, "gloo", tah_share_gpus=True)
    lines = _run_wrapped(monkeypatch, caplog)
    assert calls["set_device"] == [] and calls["init"][0]["backend"] == "gloo" and calls["rendezvous"] == 0
    assert len(lines) == 1 and "without a CUDA device" in lines[0] and "staged" in lines[0]
    assert calls["init"][0]["store"] is None  # CPU runs: Megatron's own rendezvous


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


def _collectives_rank(rank: int, store_path: str, out: str) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        a, b = torch.full((5,), rank + 1.0), torch.arange(3.0) * (rank + 1)
        with share_gpus.one_collective_at_a_time(dist.group.WORLD) as manager:  # sync: done at exit
            dist.all_reduce(a)
            dist.all_reduce(b)
        c = torch.full((4,), 10.0 * (rank + 1))
        gathered = torch.empty(8)
        with share_gpus.one_collective_at_a_time(dist.group.WORLD, async_ops=True) as async_manager:
            dist.all_reduce(c, async_op=True)
            dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank)), async_op=True)
        async_manager.wait()
        Path(out).write_text(json.dumps({"a": a.tolist(), "b": b.tolist(), "c": c.tolist(), "g": gathered.tolist(),
                                         "sync_works": len(manager.works), "async_works": len(async_manager.works)}))
    finally:
        dist.destroy_process_group()


def _collectives_main(rank, store_path, outs):
    _collectives_rank(rank, store_path, outs[rank])


@pytest.mark.distributed
def test_one_collective_at_a_time_gives_the_coalesced_results(tmp_path):
    """The shared mode's stand-in for ``_coalescing_manager`` (gloo has no coalesced collectives on CUDA
    tensors): the same sums and gathers, issued at the block's exit; async handles held by the manager."""
    import json

    import torch.multiprocessing as mp

    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    mp.start_processes(_collectives_main, args=(str(tmp_path / "store"), outs), nprocs=2, join=True,
                       start_method="spawn")
    for out in outs:
        got = json.loads(Path(out).read_text())
        assert got["a"] == [3.0] * 5 and got["b"] == [0.0, 3.0, 6.0]
        assert got["c"] == [30.0] * 4 and got["g"] == [0.0] * 4 + [1.0] * 4
        assert got["sync_works"] == 0 and got["async_works"] == 2


def test_the_shared_mode_replaces_ddps_coalescing_manager_until_restored():
    from megatron.core.distributed import param_and_grad_buffer

    original = param_and_grad_buffer._coalescing_manager
    patches = Patches()
    share_gpus.share_collectives(patches)
    share_gpus.share_collectives(patches)  # twice: one replacement
    try:
        assert param_and_grad_buffer._coalescing_manager is share_gpus.one_collective_at_a_time
        with pytest.raises(ValueError, match="device-style"):
            with share_gpus.one_collective_at_a_time(object(), device=torch.device("cpu")):
                pass
    finally:
        patches.restore()
    assert param_and_grad_buffer._coalescing_manager is original
