"""benchmarks.transfer: messages captured at emulated boundaries, codec errors on them after the first token, and
the table that flags a codec whose real error is far above its toy error."""

import pytest
import torch

from benchmarks.transfer import __main__ as transfer
from benchmarks.depth import boundaries as depth_boundaries
from benchmarks.depth.boundaries import Boundaries, _RoundTrip
from benchmarks.common.codecs import CODECS


def test_boundaries_capture_the_first_messages_of_the_chosen_iterations(tmp_path, monkeypatch):
    iteration = {"now": 100}
    monkeypatch.setattr(depth_boundaries, "_iteration", lambda: iteration["now"])
    b = Boundaries([2, 5], {}, {}, capture=tmp_path / "toy", capture_at=[100, 250])
    for now in (99, 100, 100, 250):
        iteration["now"] = now
        for layer in (2, 5):
            x = torch.randn(8, 1, 16, requires_grad=True)
            y = _RoundTrip.apply(x, b, layer)
            assert torch.equal(y, x)  # uncompressed: the message itself
            y.backward(torch.full_like(y, float(layer)))
    names = sorted(p.name for p in (tmp_path / "toy").iterdir())
    assert names == sorted(f"i{i}_b{layer}_{d}_0.pt" for i in (100, 250) for layer in (2, 5)
                           for d in ("forward", "backward"))
    found = transfer.toy_messages(tmp_path / "toy")
    assert set(found) == {(layer, d) for layer in (2, 5) for d in ("forward", "backward")}
    assert all(len(xs) == 2 for xs in found.values())
    assert torch.equal(found[(5, "backward")][0], torch.full((8, 1, 16), 5.0))
    with pytest.raises(FileNotFoundError, match="no captured messages"):
        transfer.toy_messages(tmp_path)


def test_capture_command_runs_the_bf16_loss_run_with_capture_and_stops_after_the_last_iteration(tmp_path, monkeypatch):
    from benchmarks.speedrun import runs

    monkeypatch.setattr(runs, "prepare_data", lambda out, size: (str(out / "data" / "corpus"), 8192))
    command = transfer.capture_command(tmp_path / "toy", tmp_path)
    cut = command.index("--")
    assert command[command.index("--capture") + 1] == str(tmp_path / "toy") and command.index("--capture") < cut
    assert command[command.index("--capture-at") + 1] == "100,250,400"
    assert command[-2:] == ["--exit-interval", "401"]  # the step with curr_iteration 400 runs, then it exits
    assert command[command.index("--seed") + 1] == "1234" and command[command.index("--forward") + 1] == "{}"
    assert command[command.index("--tah-log-json") + 1].startswith(str(tmp_path / "toy"))  # not the speedrun's log


def with_sink(x: torch.Tensor, factor: float = 100.0) -> torch.Tensor:
    """``x`` whose first token is ``factor`` times larger (an attention sink)."""
    x = x.clone()
    x[0] *= factor
    return x


def messages(sink: bool, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in (1, 2):
        for direction in transfer.DIRECTIONS:
            x = torch.randn(64, 1, 128, generator=gen)
            out[(layer, direction)] = [(with_sink(x) if sink else x).to(torch.bfloat16)]
    return out


def test_a_sink_costs_a_per_channel_codec_its_accuracy_on_the_other_tokens_and_not_hadint():
    clean, sunk = messages(sink=False), messages(sink=True)
    channel9, hadint4 = CODECS["channel9"], CODECS["hadint4"]
    # errors are measured after the first token: the sink's own error does not count, its effect on the scales does
    assert transfer.measure(channel9, sunk)["forward"] > 10 * transfer.measure(channel9, clean)["forward"]
    assert transfer.measure(hadint4, sunk)["forward"] == pytest.approx(transfer.measure(hadint4, clean)["forward"],
                                                                       rel=0.1)


def test_the_table_flags_the_directions_whose_real_error_is_far_above_the_toys():
    speedrun = {"table": [{"codec": "channel9", "multiplier": 1.08}, {"codec": "hadint4", "multiplier": None,
                                                                        "missed_within": {"1234": 500}}]}
    result = transfer.run(messages(sink=False), messages(sink=True, seed=1),
                          {name: CODECS[name] for name in ("bf16", "hadint4", "channel9")}, speedrun)
    rows = {r["codec"]: r for r in result["rows"]}
    assert set(rows) == {"hadint4", "channel9"}  # bf16 is not a codec to judge
    assert rows["channel9"]["ratio"]["forward"] > transfer.OPTIMISTIC > rows["hadint4"]["ratio"]["forward"]
    assert rows["channel9"]["toy_bits"]["forward"] == pytest.approx(6.52, abs=0.01)
    text = transfer.table(result)
    line = {cells.split(" | ")[0].strip("| "): cells for cells in text.splitlines() if cells.startswith("| ")}
    assert "x)**" in line["channel9"].split(" | ")[2] and "**" not in line["hadint4"]
    assert line["channel9"].endswith("| 1.08x |") and line["hadint4"].endswith("| missed within 500 steps |")
    assert text.endswith("Both directions hold up for `hadint4`.")
    assert 0 < result["toy_share16"]["forward"] < 1
