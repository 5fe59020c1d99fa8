"""The WAN ledger on megatron-core's own training step (schedules, DDP, ``finalize_model_grads``, Adam) at PP=2 and
PP=4 with tied embeddings: every byte that crosses a stage boundary, per category, against sizes computed by hand;
each collective's billing rule; nothing counted inside one stage; the patches restored exactly.

Sizes (tiny_gpt: hidden 128, vocabulary 128, sequence 32, micro-batch 2, 4 micro-batches, fp32):

* pipeline: one activation per micro-batch and boundary forward, one gradient backward, each
  ``32 x 2 x 128 x 4 = 32768`` bytes behind the ``none`` codec's 16-byte header: 32784 bytes;
* embedding: megatron-core's all-reduce of the ``128 x 128`` fp32 word-embedding gradient between the first
  and the last stage: a 2-rank all-reduce bills ``2 (N - 1) / N x 65536 = 65536`` bytes to each end;
* other: the grad-norm all-reduce of one fp32 over the model-parallel group (``2 (N - 1) / N x 4``).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_gpt
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed
ENV = {"TRITON_INTERPRET": "1"}
MESSAGE = 16 + tiny_gpt.SEQ * tiny_gpt.MICRO_BATCH * tiny_gpt.HIDDEN * 4  # none codec: header + fp32 values
EMBEDDING = tiny_gpt.VOCAB * tiny_gpt.HIDDEN * 4


def _targets():
    c10d = torch.distributed.distributed_c10d
    from megatron_tah.megatron import ledger

    return {name: (getattr(c10d, name), getattr(torch.distributed, name)) for name in ledger.COUNTED}


def _iterations(model, optimizer, n):
    from megatron_tah.megatron.registry import REGISTRY

    out = []
    for _ in range(n):
        tiny_gpt.train(model, 1, ddp_optimizer=optimizer)
        out.append(REGISTRY.stats.collect(reset=True)["wan"])
    return out


def _billing(rank, world_size):
    """Each rule of ``ledger.COUNTED`` once, over the pipeline group (all stages) and over one stage."""
    from megatron.core import parallel_state

    from megatron_tah.megatron.registry import REGISTRY

    dist = torch.distributed
    pp = parallel_state.get_pipeline_model_parallel_group()
    n, me = pp.size(), pp.rank()
    x = torch.ones(10)  # 40 bytes
    bills = {}

    def bill(name, call):
        REGISTRY.stats.collect(reset=True)
        call()
        wan = REGISTRY.stats.collect(reset=True)["wan"]
        bills[name] = sum(c["bytes"] for c in wan.values()), {k: c["ops"] for k, c in wan.items() if c["ops"]}

    bill("all_reduce", lambda: dist.all_reduce(x.clone(), group=pp))
    bill("broadcast", lambda: dist.broadcast(x.clone(), src=dist.get_global_rank(pp, 0), group=pp))
    bill("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(10 * n), x, group=pp))
    bill("all_gather", lambda: dist.all_gather([torch.empty(10) for _ in range(n)], x, group=pp))
    bill("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(10), torch.ones(10 * n), group=pp))
    bill("all_to_all_single", lambda: dist.all_to_all_single(torch.empty(10 * n), torch.ones(10 * n), group=pp))
    bill("reduce", lambda: dist.reduce(x.clone(), dst=dist.get_global_rank(pp, 0), group=pp))
    bill("all_gather_object", lambda: dist.all_gather_object([None] * n, "ab", group=pp))  # through all_gather
    nxt, prv = dist.get_global_rank(pp, (me + 1) % n), dist.get_global_rank(pp, (me - 1) % n)

    def ring():  # batch_isend_irecv goes through isend; P2POp still accepts the counted isend
        ops = [dist.P2POp(dist.isend, x, nxt, group=pp), dist.P2POp(dist.irecv, torch.empty(10), prv, group=pp)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    bill("batch_isend_irecv", ring)
    bill("world_all_reduce", lambda: dist.all_reduce(x.clone()))  # the default group spans the stages too
    alone = dist.new_group([rank])  # a group inside one stage: nothing crosses
    bill("one_stage", lambda: dist.all_reduce(x.clone(), group=alone))
    return bills


def _scenario(rank, world_size, pp):
    from megatron.core import parallel_state

    import megatron_tah
    from megatron_tah.config import TahConfig

    before = _targets()
    model = tiny_gpt.build(pp=pp, layers=pp, tied=True)
    ddp, optimizer = tiny_gpt.wrap_ddp(model, False, 3e-3)
    megatron_tah.install(TahConfig())
    out = {"default": _iterations(ddp, optimizer, 2), "billing": _billing(rank, world_size)}
    megatron_tah.uninstall()
    out["restored"] = _targets() == before
    out["stage"] = parallel_state.get_pipeline_model_parallel_rank()
    return tiny_gpt.plain(out)


def _check_default(results, pp):
    micro_batches = tiny_gpt.MICRO_BATCHES
    for r in results:
        first, last = r["stage"] == 0, r["stage"] == pp - 1
        for i, wan in enumerate(r["default"]):
            sends = micro_batches * ((not last) + (not first))  # activations forward, gradients backward
            assert wan["pipeline"] == {"ops": sends, "bytes": sends * MESSAGE, "codec_bytes": 0}, (r["stage"], i, wan)
            embedding = {"ops": 1, "bytes": EMBEDDING, "codec_bytes": 0} if first or last else \
                {"ops": 0, "bytes": 0, "codec_bytes": 0}
            assert wan["embedding"] == embedding, (r["stage"], i, wan)
            assert wan["dp"]["ops"] == 0
            # the grad norm's fp32 all-reduce over the pp stages; the first iteration adds the pipeline's
            # configuration handshake (a 1024-byte record all-gathered over the pipeline group)
            handshake = (pp - 1) * 1024 if i == 0 else 0
            assert wan["other"]["bytes"] == 2 * (pp - 1) * 4 // pp + handshake, (r["stage"], i, wan)
        assert r["restored"]


def _check_billing(results, pp):
    for r in results:
        me = r["stage"]
        b = {name: value[0] for name, value in r["billing"].items()}
        assert b["all_reduce"] == 2 * (pp - 1) * 40 // pp
        assert b["broadcast"] == ((pp - 1) * 40 if me == 0 else 0)
        assert b["all_gather_into_tensor"] == b["all_gather"] == (pp - 1) * 40
        assert b["reduce_scatter_tensor"] == (pp - 1) * 40
        assert b["all_to_all_single"] == (pp - 1) * 40  # the parts for the other ranks
        assert b["reduce"] == (0 if me == 0 else 40)
        assert b["batch_isend_irecv"] == 40 and r["billing"]["batch_isend_irecv"][1] == {"pipeline": 1}
        assert b["world_all_reduce"] == 2 * (pp - 1) * 40 // pp
        assert b["one_stage"] == 0 and r["billing"]["one_stage"][1] == {}
        # an object all-gather: the sizes (one int64), then the pickles padded to the longest
        ops = r["billing"]["all_gather_object"][1]
        assert ops == {"other": 2} and b["all_gather_object"] > (pp - 1) * 8


def test_pp2_ledger_by_hand():
    results = run_distributed(_scenario, 2, 2, env=ENV, timeout=900)
    _check_default(results, 2)
    _check_billing(results, 2)


def test_pp4_ledger_by_hand():
    results = run_distributed(_scenario, 4, 4, env=ENV, timeout=1200)
    _check_default(results, 4)
    _check_billing(results, 4)
