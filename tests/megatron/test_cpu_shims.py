"""CPU shims: applied only without CUDA, make Megatron's CUDA-only calls work on CPU, revert exactly."""

from __future__ import annotations

import importlib

import pytest
import torch

import megatron_tah
from megatron_tah.megatron import cpu_shims
from megatron_tah.megatron.patching import resolve

random = pytest.importorskip("megatron.core.tensor_parallel.random")
from megatron.core import utils  # noqa: E402
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax  # noqa: E402
from megatron.core.optimizer import optimizer as megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import p2p_communication, schedules  # noqa: E402
from megatron.training import initialize, training  # noqa: E402

TRACKER = random.CudaRNGStatesTracker


def _originals() -> dict:
    """Every attribute a shim replaces, as it is now."""
    found = {f"{m}.torch": importlib.import_module(m).torch for m in cpu_shims.SHIMMED_MODULES}
    for owner, attribute in cpu_shims.TYPE_CHECKED:
        found[f"{owner}.{attribute}"] = getattr(resolve(owner), attribute)
    found.update({
        "tracker.add": TRACKER.__dict__["add"], "tracker.fork": TRACKER.__dict__["fork"],
        "Tensor.cuda own": "cuda" in torch.Tensor.__dict__, "Module.cuda": torch.nn.Module.__dict__["cuda"],
        "warmup": initialize._warmup_jit_function, "iterators": training.build_train_valid_test_data_iterators,
        "softmax": FusedScaleMaskSoftmax.__dict__["is_kernel_available"],
        "get rng": random._get_cuda_rng_state, "set rng": random._set_cuda_rng_state,
    })
    return found


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


def test_every_shim_names_the_upstream_lines_it_covers():
    for module, lines in cpu_shims.SHIMMED_MODULES.items():
        assert ":" in lines and importlib.import_module(module)  # "call :line" and the module exists
    for owner, attribute in cpu_shims.TYPE_CHECKED:
        name = owner.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
        assert name in cpu_shims.__doc__ or attribute in cpu_shims.__doc__


def test_applied_idempotent_and_reverted_exactly(originals):
    assert cpu_shims.apply_cpu_shims(force=True) is True
    shimmed = _originals()
    changed = {k for k in originals if shimmed[k] is not originals[k] and shimmed[k] != originals[k]}
    assert changed == set(originals), set(originals) - changed  # every one of them replaced
    assert cpu_shims.apply_cpu_shims(force=True) is True and _originals() == shimmed  # idempotent
    cpu_shims.remove_cpu_shims()
    restored = _originals()
    assert all(restored[k] is originals[k] or restored[k] == originals[k] for k in originals)
    assert "cuda" not in torch.Tensor.__dict__  # the inherited C method shows through again
    cpu_shims.remove_cpu_shims()  # no-op


def test_shimmed_calls_run_on_cpu(originals):
    assert cpu_shims.apply_cpu_shims(force=True)
    counter = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    assert counter.device.type == "cpu" and counter.item() == 0
    assert schedules.torch.zeros(2, device="cpu").device.type == "cpu"
    assert schedules.torch.Tensor is torch.Tensor  # everything else is torch itself
    assert torch.empty(3, device=p2p_communication.torch.cuda.current_device()).device.type == "cpu"
    assert p2p_communication.torch.cuda.synchronize() is None
    assert initialize.torch.cuda.device_count() == 1
    with training.torch.cuda.stream(training.torch.cuda.Stream()):
        training.torch.cuda.current_stream().wait_stream(None)
    t = torch.ones(2)
    assert t.cuda() is t and t.cuda(non_blocking=True) is t
    layer = torch.nn.Linear(2, 2)
    assert layer.cuda(0) is layer
    buf = utils.GlobalMemoryBuffer()
    assert buf.get_tensor((2, 3), torch.float32, "x").device.type == "cpu"
    assert initialize._warmup_jit_function(tp_size=1) is None
    assert FusedScaleMaskSoftmax.is_kernel_available(None, None, 1, 1, 64, 64) is False


def test_cuda_type_names_only_inside_the_type_checking_callables(originals):
    assert cpu_shims.apply_cpu_shims(force=True)
    seen = []
    wrapped = cpu_shims._with_cuda_type_names(lambda t: seen.append(t.type()))
    wrapped(torch.zeros(1, dtype=torch.bfloat16))
    assert seen == ["torch.cuda.BFloat16Tensor"]
    assert torch.zeros(1).type() == "torch.FloatTensor"  # outside: the real name
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64
    # Megatron's fp32 gradient clipping runs on CPU gradients (clip_grads.py:174 asserts CUDA types).
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    megatron_optimizer.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((3,), 0.5), rtol=1e-5)


def test_data_iterators_leave_the_cpu_generator_where_it_was(originals):
    assert cpu_shims.apply_cpu_shims(force=True)
    shimmed = cpu_shims._keeping_cpu_rng_state(lambda: torch.rand(5))
    torch.manual_seed(7)
    shimmed()
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))


def test_rng_tracker_forks_reproducible_cpu_streams(originals):
    cpu_shims.apply_cpu_shims(force=True)
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_shims_stay_while_any_holder_holds_them(originals):
    from megatron_tah.megatron.registry import REGISTRY

    cpu_shims.hold_cpu_shims("plugin")
    shimmed = _originals()
    megatron_tah.install(tah_forward_codec="none")  # the second holder: nothing applied twice
    assert REGISTRY.cpu_shim_holders == {"plugin", "install"} and _originals() == shimmed
    cpu_shims.release_cpu_shims("plugin")  # released first: install still holds them
    assert cpu_shims.cpu_shims_active() and _originals() == shimmed
    megatron_tah.uninstall()
    assert not cpu_shims.cpu_shims_active() and REGISTRY.cpu_shim_holders == set() and _originals() == originals
    cpu_shims.release_cpu_shims("plugin")  # holds nothing: a no-op


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


def _products(a, b, c, x, y, z):
    return {"mm": torch.mm(a, b), "addmm": torch.addmm(c, a, b, beta=0.5, alpha=2.0), "bmm": torch.bmm(x, y),
            "baddbmm": torch.baddbmm(z, x, y, alpha=0.25), "linear": torch.nn.functional.linear(a, b.t(), c),
            "matmul": x @ y}


def test_bf16_products_run_in_fp32_and_round_once_where_the_cpu_has_no_bf16_instructions(originals):
    gen = torch.Generator().manual_seed(0)
    shapes = [(96, 80), (80, 64), (64,), (3, 40, 72), (3, 72, 24), (3, 40, 24)]
    bf16 = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    fp32 = [t.float() * 3 for t in bf16]
    native = _products(*bf16)
    wide = {name: product.bfloat16() for name, product in _products(*(t.float() for t in bf16)).items()}  # reference
    native_fp32 = _products(*fp32)
    assert cpu_shims.apply_cpu_shims(force=True, bf16_products=True)
    assert {e.target for e in cpu_shims.REGISTRY.cpu_shims.entries() if "aten::" in e.target} == {
        f"torch aten::{op} (CPU kernel)" for op in cpu_shims.BF16_PRODUCTS}
    shimmed = _products(*bf16)
    for name, product in shimmed.items():
        assert product.dtype is torch.bfloat16
        assert torch.equal(product, wide[name]), name  # the fp32 product rounded once, bit for bit
        step = native[name].float().abs().clamp_min(1e-30) * 2.0 ** -7  # one bf16 step (8 significant bits)
        assert ((product.float() - native[name].float()).abs() <= step).all(), name  # torch's bf16 kernels: same sums
    for name, product in _products(*fp32).items():
        assert torch.equal(product, native_fp32[name]), name  # other dtypes: torch's own kernels
    a, b = (t.clone().requires_grad_() for t in bf16[:2])
    (a @ b).float().square().sum().backward()  # gradients are products too
    assert a.grad.dtype is torch.bfloat16 and torch.isfinite(a.grad.float()).all()
    with pytest.raises(RuntimeError):
        torch.mm(bf16[0], fp32[1])  # mixed dtypes are refused as torch refuses them
    cpu_shims.remove_cpu_shims()
    assert not cpu_shims.REGISTRY.cpu_shims
    assert all(torch.equal(product, native[name]) for name, product in _products(*bf16).items())  # torch's again


def test_bf16_products_are_left_to_torch_where_the_cpu_has_bf16_instructions(monkeypatch, originals):
    monkeypatch.setattr(cpu_shims, "bf16_instructions", lambda: True)
    assert cpu_shims.apply_cpu_shims(force=True)
    assert not [e for e in cpu_shims.REGISTRY.cpu_shims.entries() if "aten::" in e.target]
    monkeypatch.setattr(cpu_shims, "bf16_instructions", lambda: False)
    cpu_shims.remove_cpu_shims()
    assert cpu_shims.apply_cpu_shims(force=True)
    assert len([e for e in cpu_shims.REGISTRY.cpu_shims.entries() if "aten::" in e.target]) == len(cpu_shims.BF16_PRODUCTS)
