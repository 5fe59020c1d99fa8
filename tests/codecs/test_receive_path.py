"""The receive hot path: every codec decodes straight into the receiver's buffer (no tensor of the
message's size made and then copied into it), and builds its wire layout once per (shape, dtype).

Allocations are counted with a ``TorchDispatchMode``: every storage an aten op returns that none of
its inputs had is new (kept alive until the end, so its address is never reused). Decoding into
``out`` must allocate at least ``out``'s bytes fewer than decoding into a new tensor: that is the
output itself, and an intermediate full-size copy would give those bytes back. Checked on the torch
path in bf16 and fp16 (in fp32 the reference's last computed tensor already is the values: copying
it into ``out`` is the one write) and on the Triton path, under the interpreter, in every dtype.
"""

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tah.codecs import get_codec
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.kernels import common as kcommon
from tests.helpers.codec_cases import Case, cases
from tests.helpers.edge_cases import DTYPES

SHAPE = (4, 2, 96)  # [s, b, h]; h is not a whole number of 64-channel tiles (the padding paths)
# Every registered codec but one keeping state per sample (aqsgd: its own tests below), with these options
# (the others at their defaults); those with a Triton path run it too.
OPTIONS = {"fp8": {"group_size": 32}, "int8": {"block_size": 32}, "mxfp4": {"hadamard": True}, "lowrank": {"rank": 4}}
STATELESS = cases(OPTIONS, keep=lambda case: not case.declaration.needs_sample_ids)
TRITON = cases(OPTIONS, keep=lambda case: not case.declaration.needs_sample_ids and case.make().has_triton_path())


class NewStorage(TorchDispatchMode):
    """Counts the bytes of storages that aten ops create (outputs sharing no input's storage; a storage
    passed in, as Triton's interpreter does with ``set_``, is an input)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0
        self.kept = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {leaf.untyped_storage().data_ptr() if isinstance(leaf, torch.Tensor) else leaf.data_ptr()
                  for leaf in pytree.tree_leaves((args, kwargs))
                  if isinstance(leaf, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage))}
        result = func(*args, **kwargs)
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                storage = t.untyped_storage()
                if all(storage.data_ptr() != kept.data_ptr() for kept in self.kept):
                    self.kept.append(storage)
                    self.nbytes += storage.nbytes()
        return result


def allocated(fn) -> int:
    with NewStorage() as mode:
        fn()
    return mode.nbytes


def stateless_case(case, backend, dtype):
    codec = case.make(backend=backend)
    x = activation_like(SHAPE, dtype=dtype, seed=3)
    return codec, codec.encode(x), x


@pytest.mark.parametrize("case", STATELESS)
def test_a_codec_declaring_a_kernel_runs_on_the_triton_path_here(case):
    assert case.make().has_triton_path() == case.declaration.kernel


def test_the_counter_sees_a_clone_and_not_a_view():
    x = torch.zeros(1000)
    assert allocated(lambda: x.clone()) == 4000
    assert allocated(lambda: x.view(10, 100)[3]) == 0
    assert allocated(lambda: x.add_(1)) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_none_decodes_into_out_with_one_copy_and_no_allocation(dtype):
    codec, buf, x = stateless_case(Case("none"), "torch", dtype)
    out = torch.empty_like(x)
    assert allocated(lambda: codec.decode(buf, x.shape, dtype, out=out)) == 0
    assert codec.decode(buf, x.shape, dtype, out=out) is out
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))  # the bytes, NaN patterns included
    assert allocated(lambda: codec.decode(buf, x.shape, dtype)) == x.numel() * x.element_size()  # its own copy


def check_decodes_into_out(codec, buf, x, receivers=None):
    """decode(out=t) returns t, leaves the values decode() gives, and allocates at least t's bytes fewer."""
    shape, dtype = tuple(x.shape), x.dtype
    first, second, third = receivers or (codec, codec, codec)
    want = first.decode(buf, shape, dtype)  # (also fills the codec's caches: layouts, headers, signs)
    without_out = allocated(lambda: second.decode(buf, shape, dtype))
    out = torch.full_like(x, 7.0)
    pointer = out.data_ptr()
    with_out = allocated(lambda: third.decode(buf, shape, dtype, out=out))
    assert out.data_ptr() == pointer
    assert torch.equal(out.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
    assert with_out <= without_out - out.numel() * out.element_size(), (with_out, without_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", STATELESS)
def test_torch_path_decodes_into_out_without_an_intermediate_copy(case, dtype):
    check_decodes_into_out(*stateless_case(case, "torch", dtype))


@pytest.mark.triton
@pytest.mark.skipif(kcommon.kernel_device() != "cpu", reason="counts CPU allocations under TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", TRITON)
def test_triton_path_decodes_into_out_without_an_intermediate_copy(case, dtype):
    check_decodes_into_out(*stateless_case(case, "triton", dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("warmup_samples", [100, 0])
def test_aqsgd_decodes_into_out_without_an_intermediate_copy(warmup_samples, dtype):
    options = dict(warmup_samples=warmup_samples, backend="torch")  # 100: warm-up messages; 0: deltas
    x = activation_like(SHAPE, dtype=dtype, seed=3)
    ids = torch.arange(SHAPE[1])
    sender = get_codec("aqsgd", **options)
    first, second = sender.encode(x, sample_ids=ids), sender.encode(x * 1.5, sample_ids=ids)
    receivers = [get_codec("aqsgd", **options) for _ in range(3)]
    for receiver in receivers:  # three receivers in the same state: stateful decodes cannot be repeated
        receiver.decode(first, SHAPE, dtype)
    check_decodes_into_out(receivers[0], second, x, receivers)


# ----- layouts --------------------------------------------------------------------------
def count_calls(codec, method: str) -> list:
    calls = []
    original = getattr(codec, method)

    def counted(shape, dtype, *rest):
        calls.append((tuple(shape), dtype, *rest))
        return original(shape, dtype, *rest)

    setattr(codec, method, counted)
    return calls


@pytest.mark.parametrize("case", STATELESS)
def test_layout_is_built_once_per_shape_and_dtype(case):
    codec = case.make()
    calls = count_calls(codec, "_sections")
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        x = activation_like(SHAPE, dtype=dtype)
        for _ in range(3):
            buf = codec.encode(x)
            codec.decode(buf, SHAPE, dtype, out=out if dtype == torch.bfloat16 else None)
            assert codec.wire_nbytes(SHAPE, dtype) == buf.numel()
    assert calls == [(SHAPE, torch.bfloat16), (SHAPE, torch.float32)]
    other = (2, 2, 64)
    assert codec.layout(other, torch.bfloat16).nbytes == codec.layout(torch.Size(other), torch.bfloat16).nbytes
    assert calls[2:] == [(other, torch.bfloat16)]


def test_aqsgd_layout_is_built_once_per_shape_dtype_and_phase():
    codec = get_codec("aqsgd", warmup_samples=4, backend="torch")
    calls = count_calls(codec, "_sections_for")
    x = activation_like(SHAPE, dtype=torch.bfloat16)
    sizes = [codec.encode(x, sample_ids=torch.arange(2)).numel() for _ in range(4)]  # 2 warm-up, 2 delta
    assert sizes[0] == sizes[1] != sizes[2] == sizes[3]
    assert calls == [(SHAPE, torch.bfloat16, 0), (SHAPE, torch.bfloat16, 1)]


def test_a_bad_shape_or_dtype_is_not_cached():
    from megatron_tah.codecs import CodecError

    codec = get_codec("fixedpoint")
    for _ in range(2):
        with pytest.raises(CodecError, match="shape"):
            codec.layout((4, 0, 64), torch.float32)
        with pytest.raises(CodecError, match="dtype"):
            codec.layout(SHAPE, torch.int32)
    assert not codec._layouts
