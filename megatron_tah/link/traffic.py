"""Which codec a link end's next message goes through (``Traffic``): the warm-up / evaluation switch.

A message goes through its link end's codec (an auto link end's choice for the iteration, ``auto.AutoEnd.begin``)
except during the warm-up (``--tah-warmup-iters``: Megatron's first training iterations) and inside
``evaluation(uncompressed=True)``, when it goes through ``none``; inside ``evaluation(uncompressed=False)`` a
link end with an evaluation codec (forward, ``--tah-eval-forward-bits``: ``Link.eval_codec``) sends and
receives through that one. Both ends of a link switch together: they read the same training iteration and enter
evaluations together.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from ..codecs import Codec, get_codec
from ..config import TahConfig

__all__ = ["Traffic"]


class Traffic:
    """The switch of one transport: ``iteration()``, the current training iteration (None: unknown, outside a
    training loop); ``uncompressed``, the ``none`` codec it switches to; ``evaluating``, inside an
    ``evaluation``; ``eval_uncompressed``, inside ``evaluation(uncompressed=True)``."""

    def __init__(self, config: TahConfig, iteration: Callable[[], int | None]):
        self.config, self.iteration = config, iteration
        self.uncompressed = get_codec("none").defer_checks()  # warm-up and uncompressed evaluations
        self.evaluating = self.eval_uncompressed = False

    def training_iteration(self) -> int:
        """``iteration()``, which the warm-up and auto need: both ends of a link switch together."""
        iteration = self.iteration()
        if iteration is None:
            raise RuntimeError("megatron_tah: --tah-warmup-iters counts Megatron's training iterations and needs "
                               "its training loop (megatron.training's args are not set)")
        return iteration

    def codec(self, link) -> Codec:
        """The codec of ``link``'s next message (a ``link.Link``): ``none`` during the warm-up and uncompressed
        evaluations, its evaluation codec (if it has one) in the other evaluations."""
        if link.auto is not None:
            link.codec = link.auto.begin(self.training_iteration())
        if self.config.tah_warmup_iters and self.training_iteration() < self.config.tah_warmup_iters:
            return self.uncompressed
        if self.evaluating:
            if self.eval_uncompressed:
                return self.uncompressed
            if link.eval_codec is not None:
                return link.eval_codec
        return link.codec

    @contextlib.contextmanager
    def evaluation(self, uncompressed: bool):
        """An evaluation, every message through ``none`` with ``uncompressed``, else through the link ends'
        evaluation codecs where they have one; the previous setting after it."""
        before = self.evaluating, self.eval_uncompressed
        self.evaluating, self.eval_uncompressed = True, bool(uncompressed)
        try:
            yield
        finally:
            self.evaluating, self.eval_uncompressed = before
