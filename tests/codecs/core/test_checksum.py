"""The payload checksum in the wire header: corruption is detected (full and deferred checks), clean
buffers pass unchanged, the value matches an independent definition on any view, and mismatched ends
get a clear error."""

import random

import pytest
import torch

from megatron_tah.codecs import PayloadChecksumError, WireFormatError, get_codec
from megatron_tah.codecs.core.errors import link_text
from megatron_tah.codecs.core.header import CHECKSUM_OFFSET, HEADER_NBYTES, WIRE_VERSION
from megatron_tah.codecs.core import checksum as checksum_module
from megatron_tah.codecs.core.checksum import CHUNK, PRIME, PayloadChecksum, checksum_bytes, payload_checksum
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.config import TahConfig
from tests.helpers.codec_cases import Case, cases, encode

SHAPE = (16, 2, 128)
TRIALS = 200


def reference_checksum(data: bytes) -> int:
    """The docstring's definition in Python integers: 1 + sum((i + 1) * uint16 word i) mod P."""
    words = [int.from_bytes(data[i : i + 2], "little") for i in range(0, len(data), 2)]
    return 1 + sum((i + 1) * w for i, w in enumerate(words)) % PRIME


def make(name: str | Case, checksum: bool = True):
    return (name if isinstance(name, Case) else Case(name)).make(checksum=checksum)


def corrupt(buf: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A copy of ``buf`` with 1 to 8 distinct payload bytes changed (XOR with a nonzero byte)."""
    bad = buf.clone()
    for pos in rng.sample(range(HEADER_NBYTES, buf.numel()), rng.randint(1, 8)):
        bad[pos] ^= rng.randint(1, 255)
    return bad


@pytest.fixture(scope="module")
def message():
    return activation_like(SHAPE, dtype=torch.bfloat16, seed=3)


# ----- the value -------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, 2, 8, 2 * CHUNK - 2, 2 * CHUNK, 2 * CHUNK + 2, 4 * CHUNK + 6])
def test_checksum_matches_its_definition(nbytes):
    gen = torch.Generator().manual_seed(nbytes)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    value = payload_checksum(payload)
    assert value.dtype == torch.int64 and value.dim() == 0
    assert int(value) == reference_checksum(bytes(payload.tolist()))
    assert bytes(checksum_bytes(value).tolist()) == int(value).to_bytes(4, "little")


def test_checksum_is_never_zero_and_fits_the_field():
    ones = torch.full((2 * CHUNK + 2,), 255, dtype=torch.uint8)  # the largest words
    for payload in (torch.zeros(64, dtype=torch.uint8), ones):
        assert 1 <= int(payload_checksum(payload)) <= PRIME < 2**32


def test_checksum_is_the_same_for_any_view_of_the_same_bytes():
    x = torch.randn(3, 1000)
    as_bytes = x.view(torch.uint8).reshape(-1)
    want = int(payload_checksum(as_bytes.clone()))
    assert int(payload_checksum(x.view(torch.int16).view(torch.uint8).reshape(-1))) == want
    assert int(payload_checksum(x.to(torch.float64).to(torch.float32).view(torch.uint8).reshape(-1))) == want
    # A slice of a larger buffer (a storage offset), as decode passes ``buf[16:]``.
    framed = torch.cat((torch.arange(16, dtype=torch.uint8), as_bytes))
    assert int(payload_checksum(framed[16:])) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checksum_is_the_same_on_cuda_without_a_host_sync():
    payload = torch.randint(0, 256, (2 * CHUNK + 10,), dtype=torch.uint8)
    on_device = payload.cuda()
    checksum = PayloadChecksum()
    checksum.field(checksum.value(on_device))  # (makes its constants on the device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        field = checksum.field(checksum.value(on_device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert field.cpu().tolist() == checksum_bytes(payload_checksum(payload)).tolist()


def test_the_constants_live_on_each_codec_and_the_module_keeps_no_state():
    sender, receiver = make("fixedpoint"), make("fixedpoint")
    buf = sender.encode(activation_like(SHAPE, dtype=torch.bfloat16, seed=1))
    receiver.decode(buf, SHAPE, torch.bfloat16)
    assert not bool(receiver.checksum_mismatch(buf))
    mine, theirs = sender.payload_checksum, receiver.payload_checksum
    assert mine is not theirs and mine.weights(buf.device) is mine.weights(buf.device)
    assert torch.equal(mine.weights(buf.device), theirs.weights(buf.device))
    assert set(mine._weights) == set(theirs._weights) == {"cpu"}  # made on first use, per device
    state = [name for name, value in vars(checksum_module).items()
             if isinstance(value, (dict, list, set, torch.Tensor)) and not name.startswith("__")]
    assert state == []


def test_every_single_byte_change_and_word_swap_is_detected():
    gen = torch.Generator().manual_seed(0)
    payload = torch.randint(0, 256, (96,), dtype=torch.uint8, generator=gen)
    clean = int(payload_checksum(payload))
    for pos in range(payload.numel()):
        variants = payload.repeat(255, 1)
        variants[:, pos] ^= torch.arange(1, 256, dtype=torch.uint8)
        assert all(int(payload_checksum(v)) != clean for v in variants), pos
    words = payload.view(torch.int16)
    for i, j in ((0, 1), (3, 40), (10, 47)):
        if words[i] != words[j]:
            swapped = words.clone()
            swapped[[i, j]] = words[[j, i]]
            assert int(payload_checksum(swapped.view(torch.uint8))) != clean


# ----- through the codecs --------------------------------------------------------------------------
@pytest.mark.parametrize("case", cases())
def test_clean_buffers_pass_and_decode_as_without_the_checksum(case, message):
    sender, receiver = make(case), make(case)
    plain_sender, plain_receiver = make(case, checksum=False), make(case, checksum=False)
    buf, plain = encode(sender, message), encode(plain_sender, message)
    assert buf.numel() == plain.numel() == sender.wire_nbytes(SHAPE, message.dtype)  # no extra bytes on the wire
    assert torch.equal(buf[:CHECKSUM_OFFSET], plain[:CHECKSUM_OFFSET]) and torch.equal(buf[16:], plain[16:])
    assert plain[CHECKSUM_OFFSET:HEADER_NBYTES].tolist() == [0, 0, 0, 0]
    field = int.from_bytes(bytes(buf[CHECKSUM_OFFSET:HEADER_NBYTES].tolist()), "little")
    assert field == reference_checksum(bytes(buf[HEADER_NBYTES:].tolist()))
    got = receiver.decode(buf, SHAPE, message.dtype)
    want = plain_receiver.decode(plain, SHAPE, message.dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("case", cases())
def test_every_corruption_raises_at_once_in_full_checks(case, message):
    rng = random.Random(f"full-{case.name}")
    sender, receiver = make(case), make(case)
    buf = encode(sender, message)
    for _ in range(TRIALS):
        with pytest.raises(PayloadChecksumError) as err:
            receiver.decode(corrupt(buf, rng), SHAPE, message.dtype)
        assert err.value.found != err.value.computed and err.value.count == 1
    receiver.decode(buf, SHAPE, message.dtype)  # the clean buffer still passes (aqsgd: its state is in step)


# A codec keeping state per sample (aqsgd) always checks on the host.
@pytest.mark.parametrize("case", cases(keep=lambda case: not case.declaration.needs_sample_ids))
def test_every_corruption_is_counted_on_the_device_in_deferred_checks(case, message):
    rng = random.Random(f"deferred-{case.name}")
    buf = encode(make(case), message)
    out = torch.empty(SHAPE, dtype=message.dtype)
    for _ in range(TRIALS):
        receiver = make(case).defer_checks()
        receiver.decode(corrupt(buf, rng), SHAPE, message.dtype, out=out)  # no raise: counted on the device
        assert receiver.deferred_checksum_errors(buf.device).seen(wait=True) == 1
    with pytest.raises(PayloadChecksumError, match="1 buffer.*failed the payload checksum") as err:
        receiver.decode(buf, SHAPE, message.dtype)  # the next decode raises
    assert err.value.count == 1
    clean = make(case).defer_checks()
    clean.decode(buf, SHAPE, message.dtype)
    clean.raise_deferred_errors(wait=True)


def test_a_corrupt_checksum_field_is_detected(message):
    codec = make("tah")
    buf = encode(codec, message)
    bad = buf.clone()
    bad[CHECKSUM_OFFSET + 2] ^= 0x40
    with pytest.raises(PayloadChecksumError):
        codec.decode(bad, SHAPE, message.dtype)


# ----- the two ends configured differently -----------------------------------------------------------
def test_a_receiver_with_the_checksum_on_rejects_a_buffer_without_one(message):
    buf = encode(make("fixedpoint", checksum=False), message)
    with pytest.raises(WireFormatError, match="carries no payload checksum") as err:
        make("fixedpoint").decode(buf, SHAPE, message.dtype)
    assert not isinstance(err.value, PayloadChecksumError)
    deferred = make("fixedpoint").defer_checks()
    deferred.decode(buf, SHAPE, message.dtype)
    with pytest.raises(PayloadChecksumError, match="or a sender with the checksum off"):
        deferred.raise_deferred_errors(wait=True)


def test_a_receiver_with_the_checksum_off_rejects_a_buffer_with_one(message):
    buf = encode(make("fixedpoint"), message)
    with pytest.raises(WireFormatError, match="carries a payload checksum.*has the checksum off"):
        make("fixedpoint", checksum=False).decode(buf, SHAPE, message.dtype)
    deferred = make("fixedpoint", checksum=False).defer_checks()
    deferred.decode(buf, SHAPE, message.dtype)
    with pytest.raises(WireFormatError, match="check.*failed"):
        deferred.raise_deferred_errors(wait=True)


def test_a_version_1_buffer_is_rejected_by_version(message):
    buf = encode(make("tah"), message)
    buf[2] = 1
    assert WIRE_VERSION == 2
    with pytest.raises(WireFormatError, match="version 1, this build reads version 2"):
        make("tah").decode(buf, SHAPE, message.dtype)


def test_checksum_setting_is_validated():
    with pytest.raises(ValueError, match="checksum must be True or False"):
        get_codec("tah", checksum="yes")


# ----- the error's context, and the option ------------------------------------------------------------
def test_error_names_the_link_and_iteration(message):
    buf = encode(make("tah"), message)
    buf[-3] ^= 1
    with pytest.raises(PayloadChecksumError) as err:
        make("tah").decode(buf, SHAPE, message.dtype)
    located = err.value.at(1, 2, 37)
    assert isinstance(located, PayloadChecksumError) and isinstance(located, WireFormatError)
    assert str(located).startswith("link stage 1 -> stage 2, iteration 37: tah: corrupt payload")
    assert (located.link, located.iteration) == ((1, 2), 37)
    assert (located.found, located.computed, located.codec) == (err.value.found, err.value.computed, err.value.codec)
    assert link_text(0, 1, 5) == "link stage 0 -> stage 1, iteration 5"


@pytest.mark.parametrize("on", [True, False])
def test_the_option_reaches_the_pipeline_codecs_only(on):
    config = TahConfig(tah_wire_checksum=on, tah_tp_codec="fp8", tah_dp_codec="int8")
    assert config.forward_codec().checksum is on and config.backward_codec().checksum is on
    from megatron_tah.megatron import activation_memory, data_parallel, tensor_parallel

    assert not tensor_parallel.codec(config).checksum and not data_parallel.codec(config).checksum
    assert not activation_memory.laaq_codec(config, 0, 1).checksum


# Every codec with a Triton path but one keeping state per sample (its checks are on the host).
@pytest.mark.parametrize("case", cases(keep=lambda case: case.make().has_triton_path()
                                       and not case.declaration.needs_sample_ids))
def test_the_triton_path_writes_and_checks_the_same_checksum(case, message):
    from megatron_tah.kernels.common import kernel_device, why_no_kernels

    device = kernel_device()
    if device is None:
        pytest.skip(why_no_kernels())
    x = message.to(device)
    fused = case.make(backend="triton", checksum=True)
    buf = fused.encode(x)
    assert torch.equal(buf.cpu(), make(case).encode(message))  # the torch reference's bytes, checksum included
    rng = random.Random(f"triton-{case.name}")
    for _ in range(20):
        bad = corrupt(buf, rng)
        with pytest.raises(PayloadChecksumError):
            fused.decode(bad, SHAPE, x.dtype)
        deferred = case.make(backend="triton", checksum=True).defer_checks()
        deferred.decode(bad, SHAPE, x.dtype)
        assert deferred.deferred_checksum_errors(bad.device).seen(wait=True) == 1


# ----- through the pipeline transport (2 gloo processes) ----------------------------------------------
def _corrupted_on_the_link(rank, world_size):
    """Stage 0 corrupts one payload byte of its activation message at Megatron's iteration 3 (of 3), on the
    batched plain path and on the unbatched staged one; then stages configured with and without the checksum."""
    import types

    import megatron_tah
    from megatron.training import global_vars
    from megatron_tah.link.handshake import CodecMismatchError
    from megatron_tah.megatron.pipeline_parallel import installed_transport
    from tests.link.test_message import SHAPE as STAGED_SHAPE, _exchange

    args = types.SimpleNamespace(curr_iteration=0)
    global_vars._GLOBAL_ARGS = args
    gen = torch.Generator().manual_seed(rank)
    results = {}
    for batched, staged in ((True, False), (False, True)):
        megatron_tah.install(tah_preset="paper", tah_wire_checksum=True, tah_backend="torch", tah_share_gpus=staged)
        transport = installed_transport()
        encode = transport.encode

        def corrupting(link, x, *rest_args, **kwargs):
            buf, rest = encode(link, x, *rest_args, **kwargs)
            if link.direction == "forward" and args.curr_iteration == 3:
                buf[-5] ^= 0x10
            return buf, rest

        transport.encode = corrupting
        try:
            for args.curr_iteration in (1, 2, 3):
                x = torch.randn(STAGED_SHAPE, generator=gen)
                _exchange(rank, batched, x, x)
            results[(batched, staged)] = "no error"
        except PayloadChecksumError as err:
            results[(batched, staged)] = (str(err), err.link, err.iteration)
        finally:
            megatron_tah.uninstall()
    megatron_tah.install(tah_preset="paper", tah_wire_checksum=rank == 0, tah_backend="torch")
    try:
        _exchange(rank, True, torch.zeros(STAGED_SHAPE), torch.zeros(STAGED_SHAPE))
        results["mismatch"] = "no error"
    except CodecMismatchError as err:
        results["mismatch"] = str(err)
    finally:
        megatron_tah.uninstall()
    global_vars._GLOBAL_ARGS = None
    return results


@pytest.mark.distributed
def test_a_corrupted_pipeline_message_names_its_link_and_iteration_and_mismatched_ends_fail_at_the_handshake():
    from tests.helpers.dist_utils import run_distributed

    sender, receiver = run_distributed(_corrupted_on_the_link, 2, env={"TRITON_INTERPRET": "1"}, timeout=300)
    for case in ((True, False), (False, True)):
        assert sender[case] == "no error"
        message, link, iteration = receiver[case]
        assert message.startswith("link stage 0 -> stage 1, iteration 3: tah: ") and "checksum" in message, message
        assert (link, iteration) == ((0, 1), 3)
    for rank, results in enumerate((sender, receiver)):  # refused before any message, on both stages
        assert "forward codecs" in results["mismatch"] and "payload checksum" in results["mismatch"], results
