"""The places' codec calls through CUDA graphs (``codecs.core.graphs.place_codec``), run on the CPU.

``host_reads.FakeGraphs`` stands in for ``torch.cuda.CUDAGraph`` (a capture runs the call once, a replay
runs it again under ``no_host_reads``), so the capture logic that a GPU runs runs here on CPU tensors:
on a 2-stage pipeline (both megatron-core transports) each link end captures each (op, shape, dtype) once
and replays it afterwards, what arrives is bit-identical to eager codecs, an eager fallback is logged once
with its reason, and checkpointed codec state passes through the wrappers. With the real ``CudaGraphs``
on the CPU everything runs eagerly and one line says why. The TP/DP collectives: the same.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from tests.helpers.dist_utils import run_distributed

CONFIG = dict(tah_forward_codec="lowrank", tah_lowrank_rank=4, tah_forward_bits=3,  # stateful, capturable
              tah_backward_codec="fixedpoint", tah_backward_stochastic_rounding=True,  # an eager fallback
              tah_backend="torch")
BIG, SMALL = (16, 2, 128), (8, 2, 128)
# (shape, dtype) of each message, in order: three keys, the first seen again at the end.
PLAN = [(BIG, torch.float32)] * 3 + [(SMALL, torch.float32)] * 2 + [(BIG, torch.bfloat16)] * 2 + [(BIG, torch.float32)]
SAVE_AFTER = 4  # the checkpoint is taken after this many messages
GRAPH_LOGGER = "megatron_tah.codecs.core.graphs"


def _messages():
    """(activation, gradient) per entry of PLAN: different values every message."""
    from megatron_tah.codecs.core.samples import activation_like

    return [(activation_like(shape, dtype=dtype, seed=i), activation_like(shape, dtype=dtype, seed=100 + i) * 1e-3)
            for i, (shape, dtype) in enumerate(PLAN)]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run(rank, graphs, eager=False, states=None, start=0):
    """Install CONFIG (``graphs``: how the link ends capture; None: the real CudaGraphs), optionally load
    ``states``, exchange PLAN[start:]; returns what arrived, the links, the codec states after SAVE_AFTER
    messages and the log lines."""
    import megatron_tah
    from megatron_tah.megatron.pipeline_parallel import installed_transport
    from tests.link.test_message import _exchange

    logger = logging.getLogger(GRAPH_LOGGER)
    lines = _Lines()
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        megatron_tah.install(**CONFIG, tah_eager_codecs=eager)
        transport = installed_transport()
        if graphs is not None:
            transport.graphs = graphs
        if states is not None:
            transport.states.load_state_dict(states)
        received, saved = [], None
        for i, (activation, gradient) in enumerate(_messages()[start:], start):
            received.append(_exchange(rank, i % 2 == 0, activation, gradient))
            if i + 1 == SAVE_AFTER:
                saved = copy.deepcopy(transport.states.state_dict())
        links = {key: (link.codec.captured if hasattr(link.codec, "captured") else None,
                       sorted(set(getattr(link.codec, "eager_reasons", {}).values())), link.codec.checks)
                 for key, link in transport.links.items()}
        return received, links, saved, lines.lines
    finally:
        megatron_tah.uninstall()
        logger.removeHandler(lines)


def _pipeline(rank, world_size):
    from tests.helpers.host_reads import FakeGraphs

    out = {}
    eager, _, eager_saved, eager_lines = _run(rank, None, eager=True)
    graphs = FakeGraphs()
    graphed, links, saved, lines = _run(rank, graphs)
    out["fake"] = {"identical": all(torch.equal(a, b) for a, b in zip(eager, graphed)),
                   "changed": not torch.equal(graphed[0], graphed[1]), "links": links,
                   "captures": graphs.captures, "replays": graphs.replays, "lines": lines,
                   "eager_lines": eager_lines}
    # Resumed from the checkpoint taken after SAVE_AFTER messages: the same messages as the run that went on.
    resumed = _run(rank, FakeGraphs(), states=saved, start=SAVE_AFTER)[0]
    afresh = _run(rank, FakeGraphs(), start=SAVE_AFTER)[0]
    out["resumed"] = all(torch.equal(a, b) for a, b in zip(graphed[SAVE_AFTER:], resumed))
    out["afresh_differs"] = not all(torch.equal(a, b) for a, b in zip(graphed[SAVE_AFTER:], afresh))
    out["states"] = sorted(key[:2] for key in saved) if saved else []
    out["same_states"] = sorted(saved) == sorted(eager_saved)
    # The real CudaGraphs on the CPU: eager, one line.
    cpu, cpu_links, _, cpu_lines = _run(rank, None)
    out["cpu"] = {"identical": all(torch.equal(a, b) for a, b in zip(eager, cpu)), "links": cpu_links,
                  "lines": cpu_lines}
    out["collectives"] = _collectives(rank, world_size)
    return out


def _collectives(rank, world_size):
    """all_reduce, all_gather and reduce_scatter with the fp8 codec as the TP place calls it (fake graphs)
    and eagerly: bit-identical results; each (op, shape, dtype) captured once."""
    from tests.helpers.host_reads import FakeGraphs
    from megatron_tah.codecs import get_codec
    from megatron_tah.codecs.core.graphs import place_codec
    from megatron_tah.megatron import collectives

    graphed = place_codec(get_codec("fp8", backend="torch", group_size=32), graphs=FakeGraphs())
    plain = place_codec(get_codec("fp8", backend="torch", group_size=32), eager=True)
    same = []
    for i in range(3):
        gen = torch.Generator().manual_seed(10 * i + rank)
        x = torch.randn(8, 2, 64, generator=gen)
        a, b = x.clone(), x.clone()
        collectives.all_reduce(graphed, a, None)
        collectives.all_reduce(plain, b, None)
        gathered = [torch.empty(world_size * 8, 2, 64) for _ in range(2)]
        collectives.all_gather(graphed, gathered[0], x, None)
        collectives.all_gather(plain, gathered[1], x, None)
        scattered = [torch.empty(8 // world_size, 2, 64) for _ in range(2)]
        collectives.reduce_scatter(graphed, scattered[0], x, None)
        collectives.reduce_scatter(plain, scattered[1], x, None)
        same.append(torch.equal(a, b) and not torch.equal(a, x) and torch.equal(*gathered)
                    and torch.equal(*scattered))
    return {"same": same, "captured": graphed.captured, "captures": graphed.graphs.captures,
            "replays": graphed.graphs.replays}


@pytest.mark.distributed
def test_link_ends_capture_once_replay_bit_exactly_log_fallbacks_once_and_keep_their_state():
    results = run_distributed(_pipeline, 2, env={"TRITON_INTERPRET": "1"}, timeout=600)
    keys = [(BIG, torch.float32), (SMALL, torch.float32), (BIG, torch.bfloat16)]
    for rank, r in enumerate(results):
        fake = r["fake"]
        assert fake["identical"] and fake["changed"], rank
        links = fake["links"]
        sender = ("forward", "send", 1) if rank == 0 else ("backward", "send", 0)
        receiver = ("backward", "recv", 1) if rank == 0 else ("forward", "recv", 0)
        assert links[receiver] == ([("decode", shape, dtype, "cpu") for shape, dtype in keys], [], "deferred")
        if rank == 0:  # lowrank activations: captured
            assert links[sender] == ([("encode", shape, dtype, "cpu") for shape, dtype in keys], [], "deferred")
            assert (fake["captures"], fake["replays"]) == (6, 2 * (len(PLAN) - 3))
            assert fake["lines"] == []
        else:  # gradients rounded stochastically: eager, said once
            captured, reasons, _ = links[sender]
            assert captured == [] and len(reasons) == 1 and "stochastic rounding" in reasons[0]
            assert (fake["captures"], fake["replays"]) == (3, len(PLAN) - 3)
            assert len(fake["lines"]) == 1 and "encode runs eagerly" in fake["lines"][0], fake["lines"]
        assert fake["eager_lines"] == []  # --tah-eager-codecs: no wrapper, nothing to say
        # The checkpoint: lowrank's subspace on stage 0's sender, the rounding generator on stage 1's (every
        # link end of a stateful codec has an entry); resumed, the messages continue as the run that went on.
        assert r["states"] == sorted([sender[:2], receiver[:2]]), r["states"]
        assert r["same_states"] and r["resumed"] and r["afresh_differs"], rank
        cpu = r["cpu"]
        assert cpu["identical"] and all(captured == [] for captured, _, _ in cpu["links"].values())
        assert len(cpu["lines"]) == 1 and "tensors on CPU: CUDA graphs need a CUDA device" in cpu["lines"][0]
        coll = r["collectives"]
        assert coll["same"] == [True] * 3
        # all_reduce: rows of h cut in 2 chunks (8, 64); all_gather: the input (8, 2, 64); reduce_scatter: (4, 2, 64).
        shapes = [(8, 64), (8, 2, 64), (4, 2, 64)]
        assert sorted(coll["captured"]) == sorted((op, shape, torch.float32, "cpu")
                                                  for op in ("encode", "decode") for shape in shapes)
        assert coll["captures"] == 6 and coll["replays"] > 2 * coll["captures"]


def test_tp_and_dp_places_call_their_codecs_through_graphs_unless_eager():
    pytest.importorskip("megatron.core.tensor_parallel.mappings")
    import megatron_tah
    from megatron_tah.codecs.core.graphs import GraphedCodec
    from megatron_tah.megatron.registry import REGISTRY

    try:
        megatron_tah.install(tah_tp_codec="fp8", tah_dp_codec="int8", tah_backend="torch")
        for name, codec_name in (("tp", "fp8"), ("dp", "int8")):
            codec = REGISTRY.places[name].codec
            assert isinstance(codec, GraphedCodec) and codec.name == codec_name and codec.checks == "deferred"
            x = torch.randn(8, 2, 64)
            eager_error = REGISTRY.places[name].measure("forward", x)
            assert 0 < eager_error < 0.1 and codec.captured == [] and codec.eager_reasons == {}  # measured eagerly
        megatron_tah.install(tah_tp_codec="fp8", tah_dp_codec="int8", tah_backend="torch", tah_eager_codecs=True)
        assert not any(isinstance(REGISTRY.places[name].codec, GraphedCodec) for name in ("tp", "dp"))
    finally:
        megatron_tah.uninstall()
