"""CPU shims: applied only without CUDA, make the four CUDA-only calls work on CPU, revert exactly."""

from __future__ import annotations

import pytest
import torch

import megatron_tah
from megatron_tah.megatron import cpu_shims

random = pytest.importorskip("megatron.core.tensor_parallel.random")
from megatron.core import utils  # noqa: E402
from megatron.core.pipeline_parallel import p2p_communication, schedules  # noqa: E402

TRACKER = random.CudaRNGStatesTracker


def _originals():
    return {"add": TRACKER.__dict__["add"], "fork": TRACKER.__dict__["fork"], "schedules": schedules.torch,
            "p2p": p2p_communication.torch, "get_tensor": utils.GlobalMemoryBuffer.__dict__["get_tensor"]}


@pytest.fixture()
def originals():
    cpu_shims.remove_cpu_shims()
    before = _originals()
    yield before
    cpu_shims.remove_cpu_shims()


def test_not_applied_when_cuda_is_available(monkeypatch, originals):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_shims.apply_cpu_shims() is False
    assert not cpu_shims.cpu_shims_active()
    assert _originals() == originals


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_applied_without_cuda_idempotent_and_reverted_exactly(originals):
    assert cpu_shims.apply_cpu_shims() is True
    shimmed = _originals()
    assert all(shimmed[k] is not originals[k] for k in originals)
    assert cpu_shims.apply_cpu_shims() is True and _originals() == shimmed  # idempotent
    cpu_shims.remove_cpu_shims()
    assert all(_originals()[k] is originals[k] for k in originals)
    cpu_shims.remove_cpu_shims()  # no-op
    assert all(_originals()[k] is originals[k] for k in originals)


def test_shimmed_calls_run_on_cpu(monkeypatch, originals):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cpu_shims.apply_cpu_shims()
    counter = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    assert counter.device.type == "cpu" and counter.item() == 0
    assert schedules.torch.zeros(2, device="cpu").device.type == "cpu"
    assert schedules.torch.Tensor is torch.Tensor  # everything else is torch itself
    device = p2p_communication.torch.cuda.current_device()
    assert torch.empty(3, device=device).device.type == "cpu"
    assert p2p_communication.torch.cuda.synchronize() is None
    buf = utils.GlobalMemoryBuffer()
    t = buf.get_tensor((2, 3), torch.float32, "x")
    assert t.shape == (2, 3) and t.device.type == "cpu"
    assert buf.get_tensor((6,), torch.float32, "x").data_ptr() == t.data_ptr()  # reused


def test_rng_tracker_forks_reproducible_cpu_streams(monkeypatch, originals):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_shims.apply_cpu_shims()
    tracker = TRACKER()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    outer_before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer_before)  # the default stream is untouched
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the tracked stream advanced
    again = TRACKER()
    again.add("model-parallel-rng", 123)
    with again.fork("model-parallel-rng"):
        assert torch.equal(torch.rand(4), first)  # same seed, same stream
    with pytest.raises(RuntimeError, match="already exists"):
        again.add("other", 123)
    with pytest.raises(RuntimeError, match="not added"):
        with again.fork("missing"):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_install_applies_shims_on_cpu_and_uninstall_removes_only_its_own(originals):
    megatron_tah.install(tah_forward_codec="none")
    assert cpu_shims.cpu_shims_active()
    megatron_tah.uninstall()
    assert not cpu_shims.cpu_shims_active() and _originals() == originals
    cpu_shims.apply_cpu_shims()  # applied by someone else first: uninstall leaves them
    megatron_tah.install(tah_forward_codec="none")
    megatron_tah.uninstall()
    assert cpu_shims.cpu_shims_active()


def test_tensor_parallel_validates_and_mappings_allocate_on_cpu(monkeypatch, originals):
    import megatron.training.arguments as training_arguments
    from megatron.core.tensor_parallel import mappings

    before = training_arguments.get_device_arch_version
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_shims.apply_cpu_shims()
    assert training_arguments.get_device_arch_version() == 10  # no CUDA_DEVICE_MAX_CONNECTIONS demand on CPU
    assert mappings.torch.cuda.current_device() == "cpu"  # sequence-parallel gathers allocate on the CPU
    cpu_shims.remove_cpu_shims()
    assert training_arguments.get_device_arch_version is before and mappings.torch is torch
