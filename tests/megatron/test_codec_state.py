"""The codecs' state in Megatron's checkpoints (``megatron/codec_state.py``): written whole before Megatron's
tracker names the iteration, read back or refused with an error naming rank, iteration and file.

Unit checks with a stand-in transport, then for real: ``scripts/pretrain_gpt.sh`` at PP=2 with one rank killed
during each phase of a checkpoint save (``tests/helpers/save_faults/sitecustomize.py``) resumes by itself from the
last complete checkpoint and ends with the uninterrupted run's losses, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_tah.config import TahConfig
from megatron_tah.link.link import CodecStates
from megatron_tah.megatron import codec_state

REPO = Path(__file__).resolve().parents[2]
SAVE_FAULTS = REPO / "tests" / "helpers" / "save_faults"


class _Codec:
    stateful = True

    def __init__(self):
        self.state = {"generator": torch.arange(4)}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


@pytest.fixture
def transport(monkeypatch):
    """A stand-in installed transport with one stateful link end, as rank 1."""
    config = TahConfig(tah_forward_codec="tah", tah_backward_codec="fixedpoint", tah_stochastic_rounding=True)
    link = types.SimpleNamespace(codec=_Codec(), auto=None)
    links = {("forward", "send", 1): link}
    fake = types.SimpleNamespace(config=config, states=CodecStates(config, links, lambda *key: links[key]))
    monkeypatch.setattr(codec_state, "installed_transport", lambda: fake)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    return fake


def test_the_state_is_written_whole_through_a_temporary_name_and_read_back(tmp_path, transport):
    path = codec_state.save(str(tmp_path), 4)
    assert path == codec_state.state_file(str(tmp_path), 4, 1)
    assert os.listdir(os.path.dirname(path)) == ["rank_00001.pt"]  # no temporary file left
    link = transport.states.links[("forward", "send", 1)]
    link.codec.state = {}
    assert codec_state.load(str(tmp_path), 4) == path
    assert torch.equal(link.codec.state["generator"], torch.arange(4))


def test_a_missing_or_damaged_state_of_stateful_codecs_is_an_error_naming_rank_iteration_and_file(tmp_path, transport):
    with pytest.raises(codec_state.CodecStateError, match=r"rank 1: no codec state at iteration 4 .*rank_00001\.pt"):
        codec_state.load(str(tmp_path), 4)
    path = Path(codec_state.save(str(tmp_path), 4))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # what a write cut short leaves
    with pytest.raises(codec_state.CodecStateError, match=r"rank 1: the codec state of iteration 4 cannot be read"):
        codec_state.load(str(tmp_path), 4)


def test_stateless_codecs_need_no_file(tmp_path, transport):
    transport.config = TahConfig(tah_forward_codec="tah", tah_backward_codec="fixedpoint")
    transport.states = CodecStates(transport.config, {}, None)
    assert codec_state.save(str(tmp_path), 4) is None and codec_state.load(str(tmp_path), 4) is None


def test_the_state_is_on_disk_before_megatron_saves_and_writes_its_tracker(tmp_path, transport, monkeypatch):
    import megatron.training.global_vars as global_vars

    monkeypatch.setattr(global_vars, "get_args", lambda: types.SimpleNamespace(save=str(tmp_path)))
    seen = []

    def megatron_save(iteration, *args, **kwargs):  # Megatron: model, optimizer, barrier, then the tracker
        seen.append(os.path.isfile(codec_state.state_file(str(tmp_path), iteration, 1)))
        (tmp_path / "latest_checkpointed_iteration.txt").write_text(str(iteration))

    codec_state._saving(megatron_save)(6, None, None)
    assert seen == [True]


# ----- for real: a rank killed in each phase of a save, resumed by the script's restart loop ----------------
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--eval-interval", "1000", "--log-interval", "1", "--tah-stochastic-rounding"]
PHASES = {"model": (1, 29561), "optimizer": (1, 29563), "codec": (1, 29565), "tracker": (0, 29567)}


def _script(corpus: str, out: Path, port: int, fault: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, DEVICE="cpu", OUT=str(out), DATA_PREFIX=corpus, TRAIN_ITERS="6",
               SAVE_INTERVAL="2", RESTART_DELAY="1", MASTER_PORT=str(port), RATE="", LR="2e-3",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SAVE_FAULTS), str(REPO), os.environ.get("PYTHONPATH")])))
    if fault:
        env.update(TAH_SAVE_FAULT=fault, TAH_FAULT_DONE=str(out.parent / f"{out.name}.fault"))
    return subprocess.run(["bash", "scripts/pretrain_gpt.sh", "2", *TINY], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    from megatron_tah.megatron.run_log import read_records

    out = tmp_path_factory.mktemp("plain") / "run"
    result = _script(corpus, out, 29559)
    assert result.returncode == 0, result.stdout[-3000:]
    return read_records(out / "log.jsonl")


@pytest.mark.distributed
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_rank_killed_during_a_save_resumes_from_the_last_complete_checkpoint_bit_for_bit(corpus, tmp_path,
                                                                                             uninterrupted, phase):
    from megatron_tah.megatron.run_log import read_records

    rank, port = PHASES[phase]
    out = tmp_path / "run"
    result = _script(corpus, out, port, f"{phase}:{rank}:2")  # the second save: iteration 4
    output = result.stdout
    assert (tmp_path / "run.fault").exists(), output[-3000:]
    assert result.returncode == 0 and "attempt 1 failed" in output, output[-4000:]
    assert "the next attempt resumes from iteration 2" in output, output[-4000:]  # the save of 4 never completed
    assert "finished after 2 attempts (1 failed)" in output
    resumed = read_records(out / "log.jsonl")
    assert [r["iteration"] for r in resumed] == list(range(1, 7))
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in uninterrupted]  # bit for bit
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in uninterrupted]
