"""``python -m megatron_tah.launch`` and the plugin it installs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import megatron.training as megatron_training_pkg
import megatron.training.arguments as megatron_arguments
import megatron.training.global_vars as global_vars
import megatron.training.initialize as megatron_initialize
import megatron.training.training as megatron_training
import pytest
import torch
from tests.megatron.test_arguments import gpt_argv

from megatron_tah import launch
from megatron_tah.megatron import cpu_shims, pipeline_parallel, plugin
from megatron_tah.megatron.registry import REGISTRY

REPO = Path(__file__).resolve().parents[1]

# Stands in for pretrain_gpt.py: imports a sibling module, parses Megatron's arguments, reports.
SCRIPT = textwrap.dedent("""
    import json, sys
    import sibling_module
    import megatron.training.training as training
    from megatron.training.arguments import parse_args
    args = parse_args()
    print("REPORT " + json.dumps({
        "name": __name__, "argv0": sys.argv[0], "sibling": sibling_module.VALUE,
        "num_layers": args.num_layers, "pp": args.pipeline_model_parallel_size,
        "forward": args.tah_forward_codec, "high_ratio": args.tah_high_ratio,
        "log_wrapped": hasattr(training.training_log, "__wrapped__"),
        "init_wrapped": hasattr(training.initialize_megatron, "__wrapped__"),
    }))
    sys.exit(3)
""")


def run_launcher(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), WORLD_SIZE="2")
    return subprocess.run([sys.executable, "-m", "megatron_tah.launch", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_launcher_runs_script_as_main_with_tah_flags(tmp_path):
    script_dir = tmp_path / "Megatron-LM"
    script_dir.mkdir()
    (script_dir / "sibling_module.py").write_text("VALUE = 42\n")
    script = script_dir / "pretrain_gpt.py"
    script.write_text(SCRIPT)
    argv = gpt_argv(2, "--tah-forward-codec", "fixedpoint", "--tah-high-ratio", "0.6")[1:]
    result = run_launcher(str(script), *argv, cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-3000:]  # the script's own exit status
    report = json.loads(result.stdout.split("REPORT ", 1)[1].splitlines()[0])
    assert report == {"name": "__main__", "argv0": str(script), "sibling": 42, "num_layers": 4, "pp": 2,
                      "forward": "fixedpoint", "high_ratio": 0.6, "log_wrapped": True, "init_wrapped": True}


def test_launcher_reports_missing_script_and_usage(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.main([str(tmp_path / "nowhere" / "pretrain_gpt.py"), "--num-layers", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "nowhere/pretrain_gpt.py" in err and "not found" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        launch.main([])
    assert exit_info.value.code == 2
    assert "usage: python -m megatron_tah.launch SCRIPT" in capsys.readouterr().err


@pytest.fixture
def fake_initialize(monkeypatch):
    """Replace initialize_megatron (needs CUDA) by one that only sets Megatron's global args, as it would."""
    calls = []

    def initialize_megatron(**kwargs):
        monkeypatch.setattr("sys.argv", gpt_argv(2, "--tah-forward-codec", "fixedpoint",
                                                 "--tah-backward-codec", "none", "--tah-forward-bits", "3"))
        monkeypatch.setenv("WORLD_SIZE", "2")
        global_vars.set_args(megatron_arguments.parse_args())
        calls.append(kwargs)
        return "finish"

    for module in (megatron_training, megatron_initialize, megatron_training_pkg):
        monkeypatch.setattr(module, "initialize_megatron", initialize_megatron)
    yield initialize_megatron, calls
    plugin.uninstall_megatron_lm_plugin()
    global_vars.set_args(None)


def test_plugin_installs_transports_after_initialization_and_uninstalls_exactly(fake_initialize):
    original_init, calls = fake_initialize
    originals = (megatron_arguments.add_megatron_arguments, megatron_arguments.validate_args,
                 megatron_training.training_log)
    shims_before = cpu_shims.cpu_shims_active()

    plugin.install_megatron_lm_plugin()
    plugin.install_megatron_lm_plugin()  # idempotent
    assert plugin.plugin_installed()
    assert megatron_training.initialize_megatron.__wrapped__ is original_init
    assert megatron_training.training_log.__wrapped__ is originals[2]
    assert cpu_shims.cpu_shims_active() == (shims_before or not torch.cuda.is_available())
    assert not pipeline_parallel.is_installed()  # nothing compressed before Megatron is initialized

    assert megatron_training.initialize_megatron(store=None) == "finish"
    no_cuda = {} if torch.cuda.is_available() else {"allow_no_cuda": True}  # Megatron's own CPU switch
    assert calls == [{"store": None, **no_cuda}]
    assert pipeline_parallel.is_installed()
    config = REGISTRY.config
    assert (config.tah_forward_codec, config.tah_forward_bits, config.tah_backward_codec) == ("fixedpoint", 3, "none")

    plugin.uninstall_megatron_lm_plugin()
    assert not pipeline_parallel.is_installed() and not plugin.plugin_installed()
    assert (megatron_arguments.add_megatron_arguments, megatron_arguments.validate_args,
            megatron_training.training_log) == originals
    for module in (megatron_training, megatron_initialize, megatron_training_pkg):
        assert module.initialize_megatron is original_init
    assert cpu_shims.cpu_shims_active() == shims_before


def test_plugin_rejects_bad_tah_values_at_initialization(fake_initialize, monkeypatch):
    original_init, _ = fake_initialize

    def initialize_with_bad_bits(**kwargs):
        original_init(**kwargs)
        global_vars.get_args().tah_forward_bits = 1

    monkeypatch.setattr(megatron_training, "initialize_megatron", initialize_with_bad_bits)
    plugin.install_megatron_lm_plugin()
    with pytest.raises(ValueError, match="--tah-forward-bits 1"):
        megatron_training.initialize_megatron()
    assert not pipeline_parallel.is_installed()


def test_without_tah_flags_the_plugin_leaves_megatrons_transports_and_log_line_alone(monkeypatch, capsys):
    """Opt-in: a run without --tah-* flags keeps megatron-core's own p2p functions and training_log."""
    import megatron.core.pipeline_parallel.p2p_communication as p2p

    def initialize_megatron(**kwargs):
        monkeypatch.setattr("sys.argv", gpt_argv(2))  # no --tah-* flag
        monkeypatch.setenv("WORLD_SIZE", "2")
        global_vars.set_args(megatron_arguments.parse_args())
        return "finish"

    for module in (megatron_training, megatron_initialize, megatron_training_pkg):
        monkeypatch.setattr(module, "initialize_megatron", initialize_megatron)
    transports = (p2p._batched_p2p_ops, p2p._p2p_ops)
    training_log, evaluate = megatron_training.training_log, megatron_training.evaluate
    try:
        plugin.install_megatron_lm_plugin()
        assert megatron_training.training_log is not training_log  # wrapped until the flags are known
        assert megatron_training.initialize_megatron() == "finish"
        assert not pipeline_parallel.is_installed() and REGISTRY.config is None
        assert (p2p._batched_p2p_ops, p2p._p2p_ops) == transports
        assert (megatron_training.training_log, megatron_training.evaluate) == (training_log, evaluate)
        out = capsys.readouterr().out
        assert out.count("megatron_tah:") == 1 and plugin.OFF_MESSAGE in out and "--tah-preset paper" in out
    finally:
        plugin.uninstall_megatron_lm_plugin()
        global_vars.set_args(None)
    assert (megatron_training.training_log, p2p._batched_p2p_ops) == (training_log, transports[0])


def test_one_process_s_store_binds_a_port_of_its_own_and_set_variables_are_kept():
    env = {}
    launch.default_rendezvous(env)
    assert env == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    several = {"WORLD_SIZE": "2", "RANK": "1"}
    launch.default_rendezvous(several)
    assert several["RANK"] == "1" and 0 < int(several["MASTER_PORT"]) < 65536
    given = {"MASTER_PORT": "29555", "MASTER_ADDR": "10.0.0.1"}
    launch.default_rendezvous(given)
    assert (given["MASTER_PORT"], given["MASTER_ADDR"]) == ("29555", "10.0.0.1")


def test_a_gloo_world_of_one_starts_on_the_port_the_defaults_give():
    """Port 0 is what ``init_process_group`` from ``env://`` gets for one process: its store binds a free port."""
    code = ("import os, torch.distributed as d\nfrom megatron_tah.launch import default_rendezvous\n"
            "default_rendezvous()\nd.init_process_group('gloo', init_method='env://')\n"
            "print('PORT', os.environ['MASTER_PORT'], d.get_world_size())\nd.destroy_process_group()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PORT 0 1" in done.stdout
