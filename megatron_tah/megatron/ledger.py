"""The WAN ledger: every byte this rank hands to an operation that crosses a pipeline-stage boundary.

Pipeline stages may sit at different sites joined by slow links; what crosses between them is the
pipeline's messages and any collective whose process group spans stages (the tied word-embedding
gradient's all-reduce between the first and last stage, the loss, grad-norm and num-zeros
all-reduces over the model-parallel group, the timers' gathers, megatron_tah's own statistics).
This place is always on: ``install(place)`` replaces, through ``place.patches``, the collectives and
the point-to-point send that callers look up at call time --

* in ``torch.distributed`` (what megatron-core calls: ``torch.distributed.all_reduce(...)``) and in
  ``torch.distributed.distributed_c10d`` (what torch's own helpers call: ``all_gather_object`` and
  ``broadcast_object_list`` go through ``all_gather`` and ``broadcast``, ``send`` and
  ``batch_isend_irecv`` through ``isend``; replacing ``isend`` in both keeps ``P2POp``'s identity
  checks true), the same counting function in both, so nothing is counted twice:
  ``COUNTED`` below;
* the names megatron-core bound at import time (``dist_all_gather_func`` / ``dist_reduce_scatter_func``
  of ``ALIASES``), which point at the same functions.

Each call is counted, before it runs, into the statistics sink (``Stats.record_wan``, category and
bytes) when it crosses a stage boundary: a send whose peer is in this rank's pipeline group and is not
this rank; a collective whose group holds two or more ranks of this rank's pipeline group (every
group megatron-core builds is a product of parallel dimensions: either it spans the pipeline
dimension, and then holds this rank's whole pipeline group, or all its ranks share this rank's stage;
the embedding group holds the first and last stage). Before model parallelism is initialised
nothing has a stage and nothing is counted.

**Billing**: the bytes this rank sends to other ranks of the group under the bandwidth-optimal (ring or
direct) algorithm, from the tensors' sizes (numel x element size; no device sync, CPU and GPU alike):

===========================================  ==================================================
operation                                    bytes billed to this rank (``S``: its tensor; N ranks)
===========================================  ==================================================
``isend`` / ``send`` (and batched)           ``S``
``all_reduce``                               ``2 (N - 1) / N * S`` (``S`` at N = 2)
``all_gather``, ``all_gather_into_tensor``   ``(N - 1) * S`` (``S``: this rank's input)
``reduce_scatter``, ``reduce_scatter_tensor``  ``(N - 1) * S`` (``S``: this rank's output)
``all_to_all_single``, ``all_to_all``        the parts addressed to other ranks
``broadcast``, ``scatter``                   the source: ``(N - 1) * S``; others 0
``reduce``, ``gather``                       every rank but the destination: ``S``
===========================================  ==================================================

so the sum over ranks is what a ring or a direct exchange moves; a group that holds ranks of one
stage as well (a world group with data parallelism) is billed whole. Category: the embedding groups'
traffic is ``embedding``, a data-parallel group's ``dp``, other sends ``pipeline``, other collectives
``other``; bytes sent inside ``Stats.codec_traffic()`` (the compressing places) count as codec bytes too.

Not seen: collectives replayed from a CUDA graph (counted once, when captured), torch modules that bound
these functions by name at import (DTensor, FSDP2; not used by megatron-core's training here).
``uninstall`` stops the counting; the patches are then restored exactly.
"""

from __future__ import annotations

import inspect
import logging

import torch

from .patching import resolve
from .place_spec import PlaceSpec

logger = logging.getLogger(__name__)

NAME = "wan"
C10D = "torch.distributed.distributed_c10d"
DISTRIBUTED = "torch.distributed"
ALIASES = {  # megatron-core modules that bound a collective by name at import time
    "megatron.core.tensor_parallel.mappings": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.tensor_parallel.layers": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.tensor_parallel.utils": ("dist_all_gather_func",),
    "megatron.core.timers": ("dist_all_gather_func",),
    "megatron.core.distributed.param_and_grad_buffer": ("dist_all_gather_func", "dist_reduce_scatter_func"),
}


# ----- bytes per operation -------------------------------------------------------------------------
def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def _group_rank(group, global_rank, group_rank) -> int | None:
    """The group rank of a ``src`` / ``dst`` given either way (global or group rank)."""
    if group_rank is not None:
        return int(group_rank)
    if global_rank is None:
        return None
    return torch.distributed.get_group_rank(group, global_rank)


def _all_to_all_single(a, size, me):
    splits = a.get("input_split_sizes")
    x = a["input"]
    if not splits:
        return _nbytes(x) * (size - 1) // size
    row = _nbytes(x) // max(1, x.shape[0]) if x.dim() else 0
    return row * (sum(splits) - splits[me])


def _root_sends(tensor_key, src_key):
    def bill(a, size, me, group):
        root = _group_rank(group, a.get(src_key), a.get(f"group_{src_key}"))
        return (size - 1) * _nbytes(a[tensor_key]) if root == me else 0
    return bill


def _to_root(a, size, me, group):
    root = _group_rank(group, a.get("dst"), a.get("group_dst"))
    return 0 if root == me else _nbytes(a["tensor"])


def _scatter(a, size, me, group):
    root = _group_rank(group, a.get("src"), a.get("group_src"))
    if root != me:
        return 0
    return sum(_nbytes(t) for r, t in enumerate(a.get("scatter_list") or []) if r != me)


# name -> bytes billed to this rank, from the bound arguments, the group's size and this rank's group rank
COUNTED = {
    "all_reduce": lambda a, size, me, group: 2 * (size - 1) * _nbytes(a["tensor"]) // size,
    "all_gather": lambda a, size, me, group: (size - 1) * _nbytes(a["tensor"]),
    "all_gather_into_tensor": lambda a, size, me, group: (size - 1) * _nbytes(a["input_tensor"]),
    "reduce_scatter": lambda a, size, me, group: (size - 1) * _nbytes(a["output"]),
    "reduce_scatter_tensor": lambda a, size, me, group: (size - 1) * _nbytes(a["output"]),
    "all_to_all_single": lambda a, size, me, group: _all_to_all_single(a, size, me),
    "all_to_all": lambda a, size, me, group: sum(_nbytes(t) for r, t in enumerate(a["input_tensor_list"]) if r != me),
    "broadcast": _root_sends("tensor", "src"),
    "reduce": _to_root,
    "gather": _to_root,
    "scatter": _scatter,
    "isend": None,  # point to point: the peer decides (``Ledger.send``)
}


# ----- which operations cross a stage boundary -----------------------------------------------------
def _pipeline_group():
    """This rank's pipeline group (a list of them in heterogeneous layouts); None before model parallelism
    is initialised (or without megatron-core)."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_pipeline_model_parallel_group()


def _named_groups() -> dict:
    """megatron-core's embedding and data-parallel groups (the ones that exist) -> category."""
    from megatron.core import parallel_state

    named = {}
    getters = (("embedding", parallel_state.get_embedding_group, {"check_initialized": False}),
               ("embedding", parallel_state.get_position_embedding_group, {"check_initialized": False}),
               ("dp", parallel_state.get_data_parallel_group, {"with_context_parallel": False}),
               ("dp", parallel_state.get_data_parallel_group, {"with_context_parallel": True}))
    for category, getter, kwargs in getters:
        try:
            group = getter(**kwargs)
        except (AssertionError, RuntimeError, TypeError):
            continue
        for g in group if isinstance(group, list) else [group]:
            if g is not None:
                named.setdefault(g, category)
    return named


class Ledger:
    """The counting of one installed ledger (``place.transport``): which groups cross, and the records."""

    def __init__(self, place):
        self.place = place
        self.active = True
        self._pipeline_group = None  # the pipeline group the two caches below belong to
        self._pipeline: frozenset[int] = frozenset()  # its global ranks
        self._groups: dict = {}  # group -> (crosses, category, size, this rank's group rank)

    def _group(self, group):
        """(crosses, category, size, group rank) of ``group`` (None: default), or None when nothing has a
        stage yet; and the group itself."""
        dist = torch.distributed
        if not dist.is_initialized():
            return None, group
        group = group if group is not None else dist.distributed_c10d._get_default_group()
        pipeline = _pipeline_group()
        if pipeline is None:
            return None, group
        if pipeline is not self._pipeline_group:
            groups = pipeline if isinstance(pipeline, list) else [pipeline]
            self._pipeline = frozenset(r for g in groups for r in dist.get_process_group_ranks(g))
            self._pipeline_group, self._groups = pipeline, {}
        known = self._groups.get(group)
        if known is None:
            ranks = dist.get_process_group_ranks(group)
            crosses = len(self._pipeline.intersection(ranks)) > 1
            known = (crosses, _named_groups().get(group), len(ranks), dist.get_rank(group))
            self._groups[group] = known
        return known, group

    def collective(self, name: str, arguments: dict) -> None:
        known, group = self._group(arguments.get("group"))
        if known is None or not known[0]:
            return
        _, category, size, me = known
        nbytes = COUNTED[name](arguments, size, me, group)
        self.place.stats.record_wan(category or "other", nbytes)

    def send(self, arguments: dict) -> None:
        known, group = self._group(arguments.get("group"))
        if known is None:
            return
        peer = arguments.get("dst")
        if peer is None and arguments.get("group_dst") is not None:
            peer = torch.distributed.get_global_rank(group, arguments["group_dst"])
        if peer is None or peer == torch.distributed.get_rank() or peer not in self._pipeline:
            return
        category = known[1] or "pipeline"
        self.place.stats.record_wan(category, _nbytes(arguments["tensor"]))


def _counting(ledger: Ledger, name: str, original):
    signature = inspect.signature(original)

    def counted(*args, **kwargs):
        if ledger.active:
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError:
                arguments = None  # the original raises its own error
            if arguments is not None:
                if name == "isend":
                    ledger.send(arguments)
                else:
                    ledger.collective(name, arguments)
        return original(*args, **kwargs)

    counted.__name__ = counted.__qualname__ = getattr(original, "__name__", name)
    counted.__doc__ = original.__doc__
    return counted


WHY = "count the bytes that cross a pipeline-stage boundary (the WAN ledger)"


def install(place) -> None:
    """Count every operation of ``COUNTED`` (and megatron-core's ``ALIASES`` of them) that crosses a stage."""
    ledger = Ledger(place)
    place.transport = ledger
    c10d, package = resolve(C10D), resolve(DISTRIBUTED)
    replaced = {}
    for name in COUNTED:
        original = getattr(c10d, name)
        counted = _counting(ledger, name, original)
        replaced[original] = counted
        place.patches.replace(c10d, name, counted, why=WHY)
        if getattr(package, name, None) is original:
            place.patches.replace(package, name, counted, why=WHY)
    for module_name, attributes in ALIASES.items():
        try:
            module = resolve(module_name)
        except RuntimeError:
            continue  # not in this megatron-core: nothing bound there
        for attribute in attributes:
            counted = replaced.get(getattr(module, attribute, None))
            if counted is not None:
                place.patches.replace(module, attribute, counted, why=WHY)


def uninstall(place) -> None:
    """Stop counting (before the patches are restored; a name bound to a counter meanwhile passes through)."""
    if place.transport is not None:
        place.transport.active = False


PLACE = PlaceSpec(name=NAME, option=None, install=install, uninstall=uninstall)
