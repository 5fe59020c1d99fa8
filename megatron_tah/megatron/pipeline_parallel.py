"""The pipeline place: megatron-core's p2p transports replaced by the link's ``PipelineTransport``.

``install(place)`` (run by ``places.install``, i.e. ``megatron_tah.install``) builds one
``link.transport.PipelineTransport`` and replaces, through ``place.patches``,
``megatron.core.pipeline_parallel.p2p_communication``'s ``_batched_p2p_ops`` and ``_p2p_ops``
(``version.TRANSPORTS``, looked up at call time by ``P2PCommunicator._communicate``) with its
methods; what the messages are and how they travel is the link's (``megatron_tah/link/``). This
module hands the transport what it needs from Megatron: the statistics sink, the training iteration
(``args.curr_iteration``, read when a message needs it) and the interleaved schedule's virtual stages.

Megatron's ``--use-ring-exchange-p2p`` sends through ``torch.distributed.ring_exchange`` instead of
the two transports: with a pipeline codec other than ``none`` it is an error, naming the flag, while Megatron
validates its arguments (the place's ``check_args``) and again at install. Its start-up line names the two
directions' codecs (``startup``).

The module's functions (``push_sample_ids``, ``evaluation``, ``codec_states``,
``load_codec_states``, ``installed_transport``) act on the installed transport, found through
``registry.REGISTRY``.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..config import TahConfig
from ..config import pipeline as pipeline_rules
from ..link.transport import PipelineTransport
from .place_spec import PlaceSpec
from .registry import REGISTRY
from .stats import Stream
from .version import TRANSPORTS, check_installed

logger = logging.getLogger(__name__)

NAME = "pp"
P2P_MODULE = "megatron.core.pipeline_parallel.p2p_communication"
__all__ = ["PLACE", "PipelineTransport", "codec_states", "evaluation", "install", "installed_transport",
           "is_installed", "load_codec_states", "push_sample_ids", "uninstall"]


# ----- what the transport needs from Megatron ------------------------------------------------------
def _megatron_args():
    """Megatron's parsed arguments (``megatron.training``), None outside Megatron's training (not set)."""
    try:
        from megatron.training.global_vars import get_args

        return get_args()
    except (ImportError, AssertionError):
        return None


def megatron_iteration() -> int | None:
    """Megatron's ``args.curr_iteration`` (set by ``train`` before each step and kept during evaluation;
    0 before the loop starts); the same on every stage. None outside Megatron (its args are not set)."""
    args = _megatron_args()
    return None if args is None else int(getattr(args, "curr_iteration", 0) or 0)


def virtual_stages() -> int | None:
    """The interleaved schedule's virtual pipeline stages (None: not interleaved, or not initialised)."""
    from megatron.core import parallel_state

    return parallel_state.get_virtual_pipeline_model_parallel_world_size()


def pipeline_depth() -> int | None:
    """The pipeline's stages (None: not initialised): ``auto``'s steps multipliers depend on it."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def pipeline_stage() -> int | None:
    """This rank's pipeline stage (None: not initialised): a forward link's boundary (``--tah-boundary-bits``)."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank()


def check_args(config: TahConfig, args=None) -> None:
    """Megatron's arguments against the pipeline's options: ``check_ring_exchange``; ``--tah-boundary-bits``
    with the interleaved schedule (``--num-layers-per-virtual-pipeline-stage`` / ``--num-virtual-stages-per-
    pipeline-rank``), whose links wrap around the pipeline, is a ``ValueError`` naming both."""
    args = _megatron_args() if args is None else args
    check_ring_exchange(config, args)
    interleaved = any(getattr(args, name, None) for name in ("virtual_pipeline_model_parallel_size",
                                                               "num_layers_per_virtual_pipeline_stage",
                                                               "num_virtual_stages_per_pipeline_rank"))
    if config.boundary_bits() and interleaved:
        raise ValueError("megatron_tah: --tah-boundary-bits sets bits per boundary between neighbouring stages; the "
                         "interleaved schedule (virtual pipeline stages) sends around the pipeline's end: drop one")


def check_ring_exchange(config: TahConfig, args=None) -> None:
    """Raise ``ValueError`` when Megatron sends pipeline traffic by ring exchange (``--use-ring-exchange-p2p``,
    which bypasses the two transports) while a pipeline direction has a codec other than ``none``."""
    args = _megatron_args() if args is None else args
    if not getattr(args, "use_ring_exchange_p2p", False):
        return
    codecs = {f"--tah-{d}-codec": getattr(config, f"tah_{d}_codec") for d in ("forward", "backward")}
    compressed = {flag: name for flag, name in codecs.items() if name != "none"}
    if compressed:
        given = ", ".join(f"{flag} {name}" for flag, name in compressed.items())
        raise ValueError(f"megatron_tah: --use-ring-exchange-p2p sends pipeline traffic through "
                         f"torch.distributed.ring_exchange, which megatron_tah does not compress ({given}); "
                         "drop --use-ring-exchange-p2p or set the pipeline codecs to none")


def startup(config: TahConfig, args) -> list[str]:
    """The start-up line: the codecs of activations and of their gradients."""
    per_boundary = config.boundary_bits()
    bits = f" (bits per boundary {','.join(map(str, per_boundary))})" if per_boundary else ""
    return [f"> megatron_tah: pipeline activations via {config.forward_codec().describe()}{bits}, "
            f"activation gradients via {config.backward_codec().describe()}"]


# ----- the place: install / uninstall ----------------------------------------------------------
def _replacing(transport: PipelineTransport, name: str):
    """``Patches.wrap``'s factory for megatron-core's transport ``name``."""
    method = transport.batched_p2p_ops if name == "_batched_p2p_ops" else transport.p2p_ops

    def make(original):
        def transport_call(**kwargs):
            return method(**kwargs)

        return transport_call

    return make


def install(place) -> None:
    """Replace megatron-core's two pipeline transports by a new ``PipelineTransport``'s."""
    check_installed()  # the transports' contract, before anything is replaced
    check_args(place.config)
    transport = PipelineTransport(place.config, place.stats, iteration=megatron_iteration,
                                  virtual_stages=virtual_stages, depth=pipeline_depth, stage=pipeline_stage)
    place.transport = transport
    for name in TRANSPORTS:
        place.patches.wrap(P2P_MODULE, name, _replacing(transport, name),
                           why="pipeline messages through the link's codecs (TAH-Quant)")
    place.stats.buffer_source = transport.states.buffer_nbytes
    logger.info("megatron_tah: pipeline p2p compressed (forward %s, backward %s)",
                place.config.forward_codec().describe(), place.config.backward_codec().describe())


def uninstall(place) -> None:
    """Called before ``place.patches`` are restored: the transport finishes the sends it still holds (each wait
    bounded by ``--tah-peer-timeout-s``, ``link/message.py``'s outbox) and stops taking calls."""
    place.stats.buffer_source = None
    if place.transport is not None:
        place.transport.drain()


PLACE = PlaceSpec(
    name=NAME, option=None, install=install, uninstall=uninstall,
    streams=(Stream("forward", NAME, "forward", "fwd"), Stream("backward", NAME, "backward", "bwd")),
    check=pipeline_rules.check,  # its codecs and link options (TahConfig runs them too: the link reads it as it is)
    check_args=check_args, startup=startup,
)


# ----- acting on the installed transport -------------------------------------------------------
def installed_transport() -> PipelineTransport | None:
    """The installed pipeline transport (None when not installed)."""
    place = REGISTRY.places.get(NAME)
    return None if place is None else place.transport


def is_installed() -> bool:
    return installed_transport() is not None


def _installed() -> PipelineTransport:
    transport = installed_transport()
    if transport is None:
        raise RuntimeError("megatron_tah's pipeline transport is not installed; call megatron_tah.install()")
    return transport


def push_sample_ids(ids: torch.Tensor) -> None:
    """Queue the sample ids of the next micro-batch this rank will send (first stage: per forward step)."""
    _installed().sample_ids.push(ids)


@contextlib.contextmanager
def evaluation(uncompressed: bool):
    """An evaluation (forward only) runs inside this, entered on every stage together (by run_log's
    wrapper of Megatron's ``evaluate``, per ``--tah-eval-traffic``; a loop of one's own enters it around
    its evaluation): with ``uncompressed`` every link sends raw. A no-op when not installed."""
    transport = installed_transport()
    if transport is None:
        yield
        return
    with transport.traffic.evaluation(uncompressed):
        yield


def codec_states() -> dict:
    """The installed transport's link ends' codec state (``link.CodecStates.state_dict``; {} when not installed)."""
    transport = installed_transport()
    return {} if transport is None else transport.states.state_dict()


def load_codec_states(states: dict, saved_config: dict | None = None) -> None:
    """The installed transport's ``link.CodecStates.load_state_dict`` (an error when not installed)."""
    _installed().states.load_state_dict(states, saved_config)
