"""CPU support for megatron-core and ``megatron.training.pretrain`` (machines without CUDA).

Megatron-LM assumes a CUDA device. On a machine without one, every shim below turns a call
that could only fail into its CPU equivalent; nothing else changes, and on a machine with
CUDA none of them is applied. Line numbers are megatron-core 0.19.2's (the wheel); the
same calls exist in 0.20 (Megatron-LM ``main``).

1. **torch seen from Megatron's modules** (``SHIMMED_MODULES``): the module-level ``torch``
   becomes :class:`CpuTorch`, where tensor factories given a CUDA device allocate on the CPU,
   ``torch.cuda.current_device()`` is ``"cpu"``, ``device_count()`` is 1 (the CPU stands in for
   the one device of this rank, so ``initialize.py:270``'s model-parallel groups and
   ``initialize.py:447``'s model-parallel seeds are set up), and ``synchronize``, ``set_device``,
   ``empty_cache``, streams and the CUDA RNG state are no-ops.
2. **``.cuda()``** on tensors and modules (``language_module.py:307`` ``weight.data.cuda()``,
   ``dist_utils.py:174`` ``model_module.cuda(...)``, upstream ``pretrain_gpt.py``'s batch
   ``.cuda(non_blocking=True)``) returns the object itself: it already is on the CPU.
3. **CUDA tensor type names**: ``optimizer.py:1009`` (``Float16OptimizerWithFloat16Params``),
   ``distrib_optimizer.py:401`` and ``:758`` (``DistributedOptimizer``) and ``clip_grads.py:174``
   accept only ``torch.cuda.*Tensor`` parameters; while those run, ``Tensor.type()`` of a CPU
   tensor answers with the CUDA type name of the same dtype.
4. **The model-parallel RNG tracker** (``random.py:285`` ``CudaRNGStatesTracker.add`` /
   ``:311`` ``.fork``) keeps CPU generator states instead of CUDA ones.
5. **``initialize.py:508`` ``_warmup_jit_function``** warms up CUDA fusion kernels: skipped.
6. **``fused_softmax.py:233``** asks ``is_kernel_available`` whether to run the fused softmax,
   which imports the CUDA extension ``scaled_masked_softmax_cuda`` (``:357``) for fp16/bf16:
   answered ``False``, so the torch softmax runs.
7. **Resume**: on GPUs, dropout draws from the CUDA generator, which the ``DataLoader`` never
   touches; on the CPU dropout and ``DataLoader`` iterators (``training.py:4601``
   ``build_train_valid_test_data_iterators``, which draws each iterator's base seed) share the
   CPU generator, so building the iterators after a checkpoint restored the RNG state would shift
   every later dropout mask. The CPU generator state is kept unchanged across that call, so a
   resumed run continues bit for bit.
8. **``arguments.py:1414``** asks ``get_device_arch_version()`` (``torch.cuda.get_device_properties``)
   whether to require ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tensor or context parallelism (a
   CUDA kernel-ordering requirement, gone since Blackwell): on the CPU, which runs everything in
   order, it answers 10, so ``--tensor-model-parallel-size`` > 1 validates.
9. **Activation recomputation** (``random.py:528``/``:538``: ``CheckpointFunction``, used by
   ``--recompute-granularity selective`` and ``full``, saves and restores the CUDA generator state
   through ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``): there is no CUDA generator, so the
   state is empty and setting it does nothing; the CPU generator and the tracker's (CPU, item 4)
   states, which dropout draws from here, are saved and restored by the same code as before.

10. **bf16 matrix products on a CPU without bf16 instructions** (not Megatron's: torch's CPU kernels of
    ``aten::mm`` / ``addmm`` / ``bmm`` / ``baddbmm``, which multiply bf16 in plain loops when oneDNN lacks
    AVX512-BF16 and AMX -- 43x an fp32 product on an AVX2-only AMD EPYC, a real-model study step 160 s instead of
    10): the bf16 operands are multiplied in fp32 and the product rounded once to bf16, which is what the bf16
    kernels compute (fp32 accumulation) up to the order of the sums: one or two elements in 10,000 land one bf16
    step apart (``tests/megatron/test_cpu_shims.py``). Applied only where ``bf16_instructions()`` is False.

``apply_cpu_shims()`` installs all of them when ``torch.cuda.is_available()`` is False (or with
``force=True``, for tests) and returns whether they are active; ``remove_cpu_shims()`` restores
every original object exactly. Both are idempotent; nothing happens at import time. The
replacements are recorded in ``registry.REGISTRY.cpu_shims``. megatron_tah's own installers --
``megatron_tah.install`` and the Megatron-LM plugin -- apply them only through
``hold_cpu_shims(holder)`` / ``release_cpu_shims(holder)``: the shims stay while anyone holds them
(``REGISTRY.cpu_shim_holders``), and shims applied before by someone else are left to them.
"""

from __future__ import annotations

import contextlib
import logging
import types

import torch

from .patching import resolve
from .registry import REGISTRY

logger = logging.getLogger(__name__)

SHIMMED_MODULES = {
    # module: the CUDA-only calls its ``torch`` proxy makes work (0.19.2 line numbers)
    "megatron.training.initialize": "device_count/set_device :270-282, device='cuda' :509 (JIT warm-up)",
    "megatron.training.training": "device='cuda' :1131/:1137 (start-time all-reduce), :2613, :4588 ...",
    "megatron.training.checkpointing": "cuda get/set_rng_state :417/:2665, device='cuda' :375",
    "megatron.training.models.dist_utils": "current_device :174, Stream/current_stream/stream :303-306",
    "megatron.training.utils.common_utils": "device='cuda' :55, current_device :285",
    "megatron.core.timers": "synchronize :152, current_device :303",
    "megatron.core.utils": "device='cuda' :1332 (local l2 norm), current_device :715 (memory buffer)",
    "megatron.core.rerun_state_machine": "cuda get/set_rng_state :979/:992, device='cuda' :264",
    "megatron.core.optimizer.optimizer": "device='cuda' :315, current_device :1492",
    "megatron.core.optimizer.clip_grads": "device='cuda' :96 and :180",
    "megatron.core.optimizer.distrib_optimizer": "current_device :998",
    "megatron.core.distributed.distributed_data_parallel": "current_device :297, synchronize :645",
    "megatron.core.distributed.param_and_grad_buffer": "device='cuda' :1145, current_stream/stream :632/:686",
    "megatron.core.transformer.module": "current_device :261",
    "megatron.core.transformer.utils": "device='cuda' :39 (default causal mask)",
    "megatron.core.models.gpt.gpt_model": "current_device :452",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "current_device :162 (RoPE frequencies)",
    "megatron.core.tensor_parallel.layers": "current_device :305, :647 (sequence-parallel input gradient)",
    "megatron.core.tensor_parallel.mappings": "current_device :95/:145/:152/:185 (gather, reduce-scatter), :447",
    "megatron.core.pipeline_parallel.schedules": "device='cuda' :749 (token counter)",
    "megatron.core.pipeline_parallel.p2p_communication": "current_device :211, synchronize :263",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "synchronize :248",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "device=current_device :204/:252",
}
"""Megatron modules whose module-level ``torch`` is replaced by :class:`CpuTorch` (module -> lines covered)."""

TYPE_CHECKED = (
    ("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params", "__init__"),
    ("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer", "__init__"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
)
"""Callables that accept only ``torch.cuda.*Tensor`` type names (run with CUDA type names)."""

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn")
_TENSOR_TYPE = torch.Tensor.type


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA device in torch's factories
    return torch.device(device).type == "cuda"


class _NoStream:
    """A CUDA stream stand-in: the CPU runs everything in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def synchronize(self):
        return None


class CpuCuda(types.ModuleType):
    """``torch.cuda`` as a shimmed module sees it (everything not defined here is torch.cuda's)."""

    Stream = _NoStream

    def __init__(self):
        super().__init__("torch.cuda (megatron_tah cpu shim)")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def set_device(device):
        return None

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def current_stream(device=None):
        return _NoStream()

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def get_rng_state(device="cuda"):
        return torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def set_rng_state(state, device="cuda"):
        return None


class CpuTorch(types.ModuleType):
    """``torch`` as a shimmed module sees it: factories put CUDA requests on the CPU."""

    def __init__(self):
        super().__init__("torch (megatron_tah cpu shim)")
        self.cuda = CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, self._cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _cpu_factory(factory):
        def make(*args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        make.__wrapped__ = factory
        return make


# ----- replacements ------------------------------------------------------------------------
def _on_cpu_already(self, *args, **kwargs):
    """``Tensor.cuda`` / ``Module.cuda`` without CUDA: the object is on the CPU already."""
    return self


def _type_name_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and self.device.type == "cpu":
        return _TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def _with_cuda_type_names(original):
    def run(*args, **kwargs):
        torch.Tensor.type = _type_name_as_cuda
        try:
            return original(*args, **kwargs)
        finally:
            del torch.Tensor.type  # torch.Tensor.type is inherited from the C base class

    return run


def _keeping_cpu_rng_state(original):
    def run(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return original(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    return run


def _skipped(original):
    def run(*args, **kwargs):
        return None

    return run


def _unavailable(original):
    def run(*args, **kwargs):
        return False

    return run


def _no_cuda_rng_state(original):
    def get_state(*args, **kwargs):
        return torch.empty(0, dtype=torch.uint8)

    return get_state


def _in_order_device(original):
    def get_device_arch_version():
        return 10  # no CUDA kernel-ordering requirement (see item 8)

    return get_device_arch_version


def _tracker_add(self, name, seed):
    """CudaRNGStatesTracker.add on CPU: the named state is a CPU generator state seeded with ``seed``."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise RuntimeError(f"rng seed {seed} already exists")
    if name in self.states_:
        raise RuntimeError(f"rng state {name!r} already exists")
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator().manual_seed(int(seed)).get_state()


@contextlib.contextmanager
def _tracker_fork(self, name="model-parallel-rng"):
    """CudaRNGStatesTracker.fork on CPU: run the block with the CPU generator set to state ``name``."""
    if name not in self.states_:
        raise RuntimeError(f"rng state {name!r} is not added")
    outer = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)


# ----- apply / remove ----------------------------------------------------------------------
SHIMMED_FUNCTIONS = (
    ("megatron.training.initialize", "_warmup_jit_function", _skipped, "no JIT warm-up without CUDA"),
    ("megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax", "is_kernel_available", _unavailable,
     "no fused softmax kernel without CUDA"),
    ("megatron.training.training", "build_train_valid_test_data_iterators", _keeping_cpu_rng_state,
     "building the data keeps the CPU RNG state"),
    ("megatron.training.arguments", "get_device_arch_version", _in_order_device,
     "the CPU runs in order: tensor parallelism validates without CUDA_DEVICE_MAX_CONNECTIONS"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _no_cuda_rng_state, "no CUDA RNG state to read"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _skipped, "no CUDA RNG state to set"),
)
"""Functions wrapped on a CPU: (owner, attribute, wrapper factory, why)."""


def cpu_shims_active() -> bool:
    return bool(REGISTRY.cpu_shims)


def apply_cpu_shims(force: bool = False, bf16_products: bool | None = None) -> bool:
    """Install the CPU shims when CUDA is absent (or ``force``); returns whether they are active. ``bf16_products``:
    whether item 10 is among them (None: where this CPU has no ``bf16_instructions``)."""
    patches = REGISTRY.cpu_shims
    if patches:
        return True
    if torch.cuda.is_available() and not force:
        return False
    try:
        for module in SHIMMED_MODULES:
            patches.replace(module, "torch", CpuTorch(), why="torch.cuda calls on CPU tensors (no CUDA device)")
        patches.replace(torch.Tensor, "cuda", _on_cpu_already, why="tensors stay on the CPU")
        patches.replace(torch.nn.Module, "cuda", _on_cpu_already, why="modules stay on the CPU")
        for owner, attribute in TYPE_CHECKED:
            patches.wrap(owner, attribute, _with_cuda_type_names,
                         why="CPU tensors pass the optimizer's CUDA type checks")
        tracker = resolve("megatron.core.tensor_parallel.random:CudaRNGStatesTracker")
        patches.replace(tracker, "add", _tracker_add, why="the CUDA RNG tracker keeps CPU generator states")
        patches.replace(tracker, "fork", _tracker_fork, why="the CUDA RNG tracker forks CPU generator states")
        for owner, attribute, make, why in SHIMMED_FUNCTIONS:
            patches.wrap(owner, attribute, make, why=why)
        if bf16_products if bf16_products is not None else not bf16_instructions():
            for operator, kernel in BF16_PRODUCTS.items():
                patches.kernel(operator, kernel, why=BF16_WHY)
    except Exception:
        patches.restore()
        raise
    logger.info("megatron_tah: CPU shims applied to megatron-core (no CUDA device)")
    return True


def remove_cpu_shims() -> None:
    """Restore every shimmed attribute to the exact original object (no-op when not applied)."""
    REGISTRY.cpu_shims.restore()
    REGISTRY.cpu_shim_holders.clear()


def hold_cpu_shims(holder: str) -> None:
    """Apply the shims on behalf of ``holder`` ("install", "plugin") when CUDA is absent. Shims that are
    active without a holder were applied by a caller of ``apply_cpu_shims``: theirs, left alone."""
    if holder in REGISTRY.cpu_shim_holders or torch.cuda.is_available():
        return
    if cpu_shims_active() and not REGISTRY.cpu_shim_holders:
        return
    apply_cpu_shims()
    REGISTRY.cpu_shim_holders.add(holder)


def release_cpu_shims(holder: str) -> None:
    """Drop ``holder``'s hold; the shims go with the last holder (no-op for one that holds none)."""
    if holder not in REGISTRY.cpu_shim_holders:
        return
    REGISTRY.cpu_shim_holders.discard(holder)
    if not REGISTRY.cpu_shim_holders:
        remove_cpu_shims()


# ----- bf16 on a CPU ---------------------------------------------------------------------------------------------
BF16_WHY = "bf16 matrix products in fp32, rounded once (a CPU without bf16 instructions; item 10)"


def _in_fp32(out_variant):
    """A CPU kernel for an ``aten`` product whose operands are all bf16: the product of their fp32 copies, rounded
    to bf16; any other dtypes go to torch's own kernel (the ``out=`` overload, which this shim leaves alone)."""

    def kernel(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if all(t.dtype is torch.bfloat16 for t in tensors):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return out_variant(*wide, **kwargs, out=torch.empty(0, dtype=torch.float32)).to(torch.bfloat16)
        return out_variant(*args, **kwargs, out=torch.empty(0, dtype=tensors[0].dtype))

    return kernel


BF16_PRODUCTS = {"mm": _in_fp32(torch.mm), "addmm": _in_fp32(torch.addmm), "bmm": _in_fp32(torch.bmm),
                 "baddbmm": _in_fp32(torch.baddbmm)}
"""The ``aten`` operators item 10 replaces on the CPU, with their kernels (the matrix products Megatron's local
layers, attention and their gradients reach through ``matmul`` / ``linear``)."""


def bf16_instructions() -> bool:
    """Whether oneDNN has the bf16 instructions (AVX512-BF16 or AMX) torch's CPU matrix products use for bf16;
    without them torch multiplies bf16 in plain loops, tens of times slower than fp32 (``bf16_matmul_slowdown``)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_matmul_slowdown(size: int = 512, repeats: int = 3) -> float:
    """How many times longer a ``size``-square bf16 matrix product takes than an fp32 one on this CPU, one thread
    (about 1 with ``bf16_instructions``; measured 43 on an AVX2-only AMD EPYC)."""
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
            a @ b  # warm-up
            start = time.perf_counter()
            for _ in range(repeats):
                a @ b
            seconds[dtype] = time.perf_counter() - start
        return seconds[torch.bfloat16] / seconds[torch.float32]
    finally:
        torch.set_num_threads(threads)
