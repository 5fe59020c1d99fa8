"""aqsgd (AQ-SGD delta codec): both ends in lock-step, phases, the revisit gain, errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tah.codecs import CodecError, WireFormatError, get_codec
from megatron_tah.codecs.aqsgd import DELTA, WARMUP
from megatron_tah.codecs.core.samples import activation_like

S, H = 8, 96  # h not a multiple of the tile: exercises padding


def pair(**config):
    return get_codec("aqsgd", **config), get_codec("aqsgd", **config)


def send(sender, receiver, x, ids):
    ids = torch.tensor(ids)
    nbytes = receiver.wire_nbytes(x.shape, x.dtype)  # known before the message arrives
    assert sender.wire_nbytes(x.shape, x.dtype) == nbytes
    buf = sender.encode(x, sample_ids=ids)
    assert buf.numel() == nbytes
    y = receiver.decode(buf, x.shape, x.dtype)
    assert torch.equal(receiver.last_sample_ids, ids)
    return buf, y


def same_state(a, b):
    return (a.samples_seen == b.samples_seen and a.buffer.keys() == b.buffer.keys()
            and all(torch.equal(a.buffer[k], b.buffer[k]) for k in a.buffer))


def rel_error(x, y):
    return ((y.float() - x.float()).norm() / x.float().norm()).item()


def samples(n, dtype=torch.float32, seed=0):
    return {i: activation_like((S, 1, H), dtype, seed=seed + i)[:, 0, :] for i in range(n)}


def batch(data, ids, drift=0.0, epoch=0):
    columns = []
    for i in ids:
        noise = torch.randn(S, H, generator=torch.Generator().manual_seed(1000 * epoch + i))
        columns.append(data[i].float() + drift * epoch * noise)
    return torch.stack(columns, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
def test_ends_stay_bit_identical_over_epochs(dtype, buffer_dtype):
    sender, receiver = pair(bits=3, tile_size=32, warmup_samples=6, buffer_dtype=buffer_dtype)
    data = samples(6)
    for epoch in range(4):
        order = torch.randperm(6, generator=torch.Generator().manual_seed(epoch)).tolist()
        for start in range(0, 6, 2):
            ids = order[start:start + 2]
            x = batch(data, ids, drift=0.05, epoch=epoch).to(dtype)
            _, y = send(sender, receiver, x, ids)
            assert same_state(sender, receiver)
            # The receiver returns m[id], which the sender holds too.
            expect = torch.stack([sender.buffer[i] for i in ids], dim=1).float()
            if epoch == 0:
                assert torch.equal(y, x)  # warm-up: raw values, exact
            else:
                assert torch.equal(y, expect.to(dtype))
    assert sender.samples_seen == 24 and receiver.phase == DELTA
    assert sender.buffer_nbytes() == receiver.buffer_nbytes() == 6 * S * H * buffer_dtype.itemsize


def test_revisits_beat_direct_quantization_when_activations_drift_slowly():
    bits, tile = 3, 64
    sender, receiver = pair(bits=bits, tile_size=tile, warmup_samples=0)
    direct = get_codec("fixedpoint", bits=bits, tile_size=tile)
    data = samples(4, seed=7)
    errors = []
    for epoch in range(5):
        for ids in ([0, 1], [2, 3]):
            x = batch(data, ids, drift=0.01, epoch=epoch)  # a_t = a_0 + small drift
            _, y = send(sender, receiver, x, ids)
            d = direct.decode(direct.encode(x), x.shape, x.dtype)
            errors.append((epoch, rel_error(x, y), rel_error(x, d)))
    first = [e for e in errors if e[0] == 0]
    assert all(aq == pytest.approx(dq, rel=1e-6) for _, aq, dq in first)  # first visit: a delta against 0
    last = [e for e in errors if e[0] == 4]
    assert all(aq < 0.25 * dq for _, aq, dq in last), last
    revisit = [aq for e, aq, _ in errors if e >= 1]
    assert max(revisit) < min(dq for _, _, dq in errors)


def test_first_delta_equals_fixedpoint_of_the_input():
    sender, receiver = pair(bits=4, tile_size=64)
    x = activation_like((S, 3, H), torch.bfloat16, seed=3)
    _, y = send(sender, receiver, x, [10, 11, 12])
    fixed = get_codec("fixedpoint", bits=4, tile_size=64)
    expect = fixed.decode(fixed.encode(x.float()), x.shape, torch.float32).to(torch.bfloat16)
    assert torch.equal(y, expect)


def test_phase_switch_and_wire_sizes():
    sender, receiver = pair(bits=4, tile_size=32, warmup_samples=3)
    x = activation_like((S, 2, H), torch.bfloat16)
    raw, coded = sender.wire_nbytes(x.shape, x.dtype), None
    assert raw >= S * 2 * H * 2  # the raw values travel in warm-up
    phases = []
    for message in range(3):
        phases.append(receiver.phase)
        buf, _ = send(sender, receiver, x, [2 * message, 2 * message + 1])
        coded = buf.numel() if phases[-1] == DELTA else coded
    # samples_seen 0 and 2 are < 3: two warm-up messages, then deltas.
    assert phases == [WARMUP, WARMUP, DELTA]
    assert coded < raw / 3
    assert get_codec("aqsgd", warmup_samples=0).phase == DELTA


def test_buffer_nbytes_and_reset():
    sender, receiver = pair(buffer_dtype=torch.float16)
    for ids in ([0, 1], [2, 3], [1, 4]):  # 5 distinct samples, one revisited
        send(sender, receiver, activation_like((S, 2, H), torch.float32), ids)
    assert receiver.buffer_nbytes() == 5 * S * H * 2
    receiver.reset()
    assert receiver.buffer_nbytes() == 0 and receiver.samples_seen == 0


def test_nan_tile_is_reported_and_does_not_poison_the_buffer():
    sender, receiver = pair(bits=4, tile_size=32)
    data = samples(2)
    send(sender, receiver, batch(data, [0, 1]), [0, 1])
    before = receiver.buffer[0].clone()
    x = batch(data, [0, 1], drift=0.01, epoch=1)
    x[3, 0, 40] = float("nan")
    _, y = send(sender, receiver, x, [0, 1])
    assert torch.isnan(y[3, 0, 32:64]).all() and torch.isnan(y).sum() == 32
    assert torch.equal(receiver.buffer[0][3, 32:64], before[3, 32:64])  # that tile of m is unchanged
    assert same_state(sender, receiver)
    _, y = send(sender, receiver, batch(data, [0, 1], drift=0.01, epoch=2), [0, 1])
    assert torch.isfinite(y).all()


def test_warmup_stores_non_finite_values_as_zero():
    sender, receiver = pair(warmup_samples=1)
    x = torch.ones(S, 1, H)
    x[0, 0, 0] = float("inf")
    _, y = send(sender, receiver, x, [5])
    assert torch.equal(y, x)  # raw values on the wire
    assert receiver.buffer[5][0, 0] == 0 and same_state(sender, receiver)


def test_duplicate_ids_in_one_message_agree_on_both_ends():
    sender, receiver = pair(bits=4, tile_size=32)
    x = activation_like((S, 3, H), torch.float32)
    send(sender, receiver, x, [7, 7, 8])
    assert same_state(sender, receiver) and sorted(receiver.buffer) == [7, 8]


def test_determinism_and_decode_into_out():
    x = activation_like((S, 2, H), torch.bfloat16)
    a, b = get_codec("aqsgd"), get_codec("aqsgd")
    assert torch.equal(a.encode(x, torch.tensor([0, 1])), b.encode(x, torch.tensor([0, 1])))
    sender, receiver = pair()
    buf = sender.encode(x, sample_ids=torch.tensor([3, 4]))
    out = torch.empty(S, 2, H, dtype=torch.bfloat16, requires_grad=True)
    assert receiver.decode(buf, x.shape, x.dtype, out=out) is out
    assert torch.equal(out.detach(), torch.stack([sender.buffer[3], sender.buffer[4]], 1).to(torch.bfloat16))


def test_wrong_phase_order_and_config_raise():
    x = activation_like((S, 2, H), torch.float32)
    # The receiver missed the (warm-up) first message: it still expects warm-up.
    sender, receiver = pair(warmup_samples=2)
    sender.encode(x, torch.tensor([0, 1]))
    with pytest.raises(WireFormatError, match="delta message.*warm-up phase"):
        receiver.decode(sender.encode(x, torch.tensor([0, 1])), x.shape, x.dtype)
    # Same phase, messages out of order.
    sender, receiver = pair()
    sender.encode(x, torch.tensor([0, 1]))
    with pytest.raises(WireFormatError, match="out of step"):
        receiver.decode(sender.encode(x, torch.tensor([2, 3])), x.shape, x.dtype)
    # A phase byte that disagrees with an otherwise valid buffer.
    sender, receiver = pair()
    buf = sender.encode(x, torch.tensor([0, 1]))
    buf[16] = WARMUP
    with pytest.raises(WireFormatError, match="phase 0"):
        receiver.decode(buf, x.shape, x.dtype)
    # Same length, another config (buffer dtype).
    sender = get_codec("aqsgd")
    other = get_codec("aqsgd", buffer_dtype=torch.bfloat16)
    buf = sender.encode(x, torch.tensor([0, 1]))
    assert other.wire_nbytes(x.shape, x.dtype) == buf.numel()
    with pytest.raises(WireFormatError, match="another config"):
        other.decode(buf, x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="bytes"):
        get_codec("aqsgd", bits=3).decode(buf, x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="another shape"):
        get_codec("aqsgd").decode(buf, (S, 2, H), torch.bfloat16)  # the delta payload's size ignores dtype


def test_bad_arguments_raise():
    codec = get_codec("aqsgd")
    x = torch.zeros(S, 2, H)
    with pytest.raises(CodecError, match="needs sample_ids"):
        codec.encode(x)
    with pytest.raises(CodecError, match="b=2"):
        codec.encode(x, sample_ids=torch.tensor([1, 2, 3]))
    with pytest.raises(CodecError, match="integers"):
        codec.encode(x, sample_ids=torch.tensor([1.0, 2.0]))
    with pytest.raises(CodecError, match=r"\[s, b, h\]"):
        codec.encode(torch.zeros(S, H), sample_ids=torch.tensor([0]))
    with pytest.raises(CodecError, match="unsupported dtype"):
        codec.encode(x.double(), sample_ids=torch.tensor([0, 1]))
    with pytest.raises(CodecError, match="warmup_samples"):
        get_codec("aqsgd", warmup_samples=-1)
    with pytest.raises(CodecError, match="buffer_dtype"):
        get_codec("aqsgd", buffer_dtype=torch.int8)
    with pytest.raises(CodecError, match="bits"):
        get_codec("aqsgd", bits=1)
    codec.encode(x, sample_ids=torch.tensor([0, 1]))
    with pytest.raises(CodecError, match="sequence length"):
        codec.encode(torch.zeros(S + 1, 1, H), sample_ids=torch.tensor([0]))
    assert codec.config() == {"bits": 4, "tile_size": 64, "warmup_samples": 0, "buffer_dtype": "float32"}


@settings(max_examples=25, deadline=None)
@given(
    messages=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=6),
    warmup=st.integers(0, 8), bits=st.integers(2, 8), tile=st.sampled_from([8, 32, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), h=st.integers(1, 80),
)
def test_lock_step_property(messages, warmup, bits, tile, dtype, h):
    sender, receiver = pair(bits=bits, tile_size=tile, warmup_samples=warmup)
    for step, ids in enumerate(messages):
        x = torch.randn(3, len(ids), h, generator=torch.Generator().manual_seed(step)).to(dtype)
        was_warmup = receiver.phase == WARMUP
        _, y = send(sender, receiver, x, ids)
        assert same_state(sender, receiver)
        assert torch.isfinite(y).all()
        if was_warmup:
            assert torch.equal(y, x)
        else:
            last = {i: col for col, i in enumerate(ids)}  # the last column of a repeated id is stored
            for i, col in last.items():
                assert torch.equal(y[:, col], receiver.buffer[i].to(dtype))
