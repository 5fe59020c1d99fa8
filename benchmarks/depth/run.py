"""One training run with emulated pipeline boundaries (``boundaries.py``), in this process.

    python -m benchmarks.depth.run --boundaries 1,2,3,4,5,6,7 --forward '{"tah_preset": "paper"}' \\
        --backward '{"tah_preset": "paper"}' --log errors.jsonl -- <megatron_tah.pretrain_gpt flags>

``--forward`` / ``--backward``: ``TahConfig`` fields as JSON (the forward codec of the first, the backward
codec of the second; ``{}``: none). The Megatron flags are ``megatron_tah.pretrain_gpt``'s, at pipeline
depth 1 (the default); the run is one process (``RANK=0``, ``WORLD_SIZE=1``, a free local port).
``--stop-at-loss X`` ends training at the first validation at or below X (:class:`StopAtLoss`).
``--eval-from N`` skips the validations before iteration N; ``--eval-losses FILE`` appends each evaluation's
per-micro-batch losses there (:class:`EvalLosses`). With ``--tah-eval-traffic both`` every evaluation runs
through the boundaries' codecs and then uncompressed (``boundaries.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_tah.launch import default_rendezvous


class EvaluateWrap:
    """Wraps Megatron's ``evaluate`` and ``evaluate_and_print_results`` (``megatron.training.training``) with the
    subclass's ``_evaluate`` / ``_evaluate_and_print_results`` (each takes the original, returns its wrapper);
    ``restore`` puts the originals back."""

    saved: list

    def install(self) -> None:
        import functools
        import importlib

        module = importlib.import_module("megatron.training.training")
        for name, make in (("evaluate", self._evaluate), ("evaluate_and_print_results", self._evaluate_and_print_results)):
            original = getattr(module, name)
            self.saved.append((module, name, original))
            setattr(module, name, functools.wraps(original)(make(original)))

    def restore(self) -> None:
        while self.saved:
            module, name, original = self.saved.pop()
            setattr(module, name, original)


class StopAtLoss(EvaluateWrap):
    """Training ends at the first validation whose loss is at or below ``target``: Megatron's loop runs while
    ``iteration < args.train_iters``, so that iteration becomes the last; the end of training (its checkpoint,
    its final evaluations) follows as usual. Wraps ``megatron.training.training``'s ``evaluate`` (the loss) and
    ``evaluate_and_print_results`` (the iteration), looked up at call time, as plain attributes: megatron_tah's
    ``Patches`` would mark them, and the plugin's logging then leaves marked functions alone."""

    def __init__(self, target: float):
        self.target, self.loss, self.stopped_at, self.saved = float(target), None, None, []

    def _evaluate(self, original):
        def evaluate(*args, **kwargs):
            result = original(*args, **kwargs)
            if self.loss is None:  # the first pass: through the codecs (--tah-eval-traffic both adds a second)
                self.loss = result[0].get("lm loss") if result and result[0] else None
            return result

        return evaluate

    def _evaluate_and_print_results(self, original):
        def evaluate_and_print_results(prefix, *args, **kwargs):
            from megatron.training.global_vars import get_args

            self.loss = None
            result = original(prefix, *args, **kwargs)
            iteration = kwargs.get("iteration", args[3] if len(args) > 3 else None)
            margs = get_args()
            if (self.loss is not None and float(self.loss) <= self.target and self.stopped_at is None
                    and iteration is not None and iteration < margs.train_iters):
                self.stopped_at = margs.train_iters = int(iteration)
                print(f"> stop-at-loss: validation loss {float(self.loss):.4f} <= {self.target} at iteration "
                      f"{iteration}: training ends here", flush=True)
            return result

        return evaluate_and_print_results


class EvalLosses(EvaluateWrap):
    """Each evaluation's losses per micro-batch, for the noise of a comparison on the same held-out tokens.

    Wraps ``megatron.training.training``'s ``evaluate_and_print_results`` (the split and the iteration;
    validations before iteration ``first`` are skipped, and the end of training's repeat of a validation just
    made) and ``evaluate`` (the
    forward step's ``"lm loss"`` report, ``[sum, tokens]`` per micro-batch), as :class:`StopAtLoss` does.
    Appends ``{"iteration", "split", "traffic", "losses"}`` per evaluation pass to ``path`` (JSON lines);
    ``traffic`` is ``"uncompressed"`` inside ``boundaries``' uncompressed switch, else ``"codec"``."""

    def __init__(self, path, boundaries, first: int = 0):
        self.path, self.boundaries, self.first = path, boundaries, int(first)
        self.at, self.last, self.saved = None, None, []

    def _evaluate_and_print_results(self, original):
        def evaluate_and_print_results(prefix, *args, **kwargs):
            from megatron.training.global_vars import get_args

            iteration = kwargs.get("iteration", args[3] if len(args) > 3 else None)
            split = "test" if "test" in str(prefix) else "valid"
            end = iteration is not None and iteration >= get_args().train_iters
            if split == "valid" and ((not end and iteration is not None and iteration < self.first)
                                     or (end and iteration == self.last)):
                return None  # before the first, or the end of training's repeat of the last validation
            if split == "valid":
                self.last = iteration
            self.at = (iteration, split)
            try:
                return original(prefix, *args, **kwargs)
            finally:
                self.at = None

        return evaluate_and_print_results

    def _evaluate(self, original):
        def evaluate(forward_step_func, *args, **kwargs):
            losses = []

            def recording(*a, **k):
                output, loss_func = forward_step_func(*a, **k)

                def record(*x, **y):
                    result = loss_func(*x, **y)
                    total, tokens = (float(v) for v in result[-1]["lm loss"])
                    losses.append(total / max(tokens, 1.0))
                    return result

                return output, record

            result = original(recording, *args, **kwargs)
            if self.at is not None and losses:
                iteration, split = self.at
                record = {"iteration": iteration, "split": split,
                          "traffic": "uncompressed" if self.boundaries.uncompressed else "codec", "losses": losses}
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            return result

        return evaluate


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, megatron = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.depth.run", description=__doc__.split("\n")[0])
    parser.add_argument("--boundaries", default="", help="layer numbers (1-based) followed by a boundary, comma list")
    parser.add_argument("--forward", default="{}", help="TahConfig fields of the forward codec, JSON")
    parser.add_argument("--backward", default="{}", help="TahConfig fields of the backward codec, JSON")
    parser.add_argument("--log", help="JSON-lines file of sampled round-trip errors and message rms")
    parser.add_argument("--per-boundary", default="{}", help='forward codec at single boundaries, JSON {"7": {...}}')
    parser.add_argument("--warmup-iters", type=int, default=0, help="first N iterations uncompressed")
    parser.add_argument("--capture", help="folder: save the messages entering the codecs in --capture-at iterations")
    parser.add_argument("--capture-at", default="", help="training iterations to capture messages in, comma list")
    parser.add_argument("--capture-per", type=int, default=1, help="messages per boundary, direction and iteration")
    parser.add_argument("--stop-at-loss", type=float,
                        help="end training at the first validation whose loss is at or below this (StopAtLoss)")
    parser.add_argument("--eval-from", type=int, default=0, help="skip the validations before this iteration")
    parser.add_argument("--eval-losses", help="JSON-lines file of each evaluation's per-micro-batch losses")
    args = parser.parse_args(ours)
    default_rendezvous()
    from .boundaries import Boundaries

    layers = [int(k) for k in args.boundaries.split(",") if k.strip()]
    boundaries = Boundaries(layers, json.loads(args.forward), json.loads(args.backward), log=args.log,
                            per_boundary=json.loads(args.per_boundary), warmup_iters=args.warmup_iters,
                            capture=args.capture, capture_at=[int(k) for k in args.capture_at.split(",") if k.strip()],
                            capture_per=args.capture_per)
    boundaries.install()
    if args.stop_at_loss is not None:
        StopAtLoss(args.stop_at_loss).install()
    if args.eval_losses or args.eval_from:
        EvalLosses(args.eval_losses or os.devnull, boundaries, args.eval_from).install()
    from megatron_tah import pretrain_gpt

    sys.argv = ["megatron_tah.pretrain_gpt", *megatron]
    pretrain_gpt.main()


if __name__ == "__main__":
    main()
