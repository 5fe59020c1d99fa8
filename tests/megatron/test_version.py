"""Support is decided by the contract the patch relies on; the version number is only the message."""

from __future__ import annotations

import textwrap

import pytest
from megatron.core.pipeline_parallel import p2p_communication as p2p

import megatron_tah
from megatron_tah.megatron import version

KEYWORDS = ", ".join(f"{k}=None" for k in version.TRANSPORT_KEYWORDS)
GOOD = textwrap.dedent(f"""
    def _batched_p2p_ops(*, {KEYWORDS}):
        return []
    def _p2p_ops(*, {KEYWORDS}):
        return {{}}
""")


def test_transport_contract_on_source():
    assert version.transport_problems(GOOD) == []
    renamed = GOOD.replace("next_pipeline_rank", "next_rank")
    assert [p.split(" takes")[0] for p in version.transport_problems(renamed)] == ["_batched_p2p_ops", "_p2p_ops"]
    positional = GOOD.replace("(*, ", "(", 1)
    assert version.transport_problems(positional)[0].startswith("_batched_p2p_ops takes")
    assert version.transport_problems("def _p2p_ops(): pass") == [
        "_batched_p2p_ops is not defined at module level",
        f"_p2p_ops takes (), not the keyword-only ({', '.join(version.TRANSPORT_KEYWORDS)})"]


def test_training_hooks_on_source():
    source = "from .checkpointing import save_checkpoint, load_checkpoint\n" + "".join(
        f"def {name}(): pass\n" for name in version.HOOKS if name not in ("save_checkpoint", "load_checkpoint"))
    assert version.hook_problems(source) == []
    assert version.hook_problems(source.replace("def evaluate()", "def evaluate2()")) == [
        "megatron/training/training.py has no evaluate"]


def test_installed_megatron_core_meets_the_contract():
    assert version.check_installed() == version.installed_version()


def test_install_refuses_a_megatron_core_whose_transports_changed(monkeypatch):
    def changed(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group, peer):
        return []

    originals = {name: getattr(p2p, name) for name in version.TRANSPORTS}
    monkeypatch.setattr(p2p, "_batched_p2p_ops", changed)
    with pytest.raises(version.UnsupportedMegatronError, match=r"megatron-core .* is not supported.*_batched_p2p_ops"):
        megatron_tah.install()
    assert p2p._p2p_ops is originals["_p2p_ops"] and p2p._batched_p2p_ops is changed  # nothing replaced
    monkeypatch.delattr(p2p, "_p2p_ops")
    with pytest.raises(RuntimeError, match="_p2p_ops"):
        megatron_tah.install()


def test_checkout_check_names_missing_files_and_versions(tmp_path):
    with pytest.raises(version.UnsupportedMegatronError, match="not a Megatron-LM checkout"):
        version.check_checkout(tmp_path)
    assert version.parse_version("0.19.0rc1+git1234") == (0, 19, 0)
    with pytest.raises(ValueError):
        version.parse_version("dev")
