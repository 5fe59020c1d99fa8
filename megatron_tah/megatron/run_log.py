"""megatron_tah's statistics in Megatron-LM's training log, TensorBoard, wandb and a JSON log.

``install_logging()`` wraps three functions of ``megatron.training.training`` (``train()`` and
``evaluate_and_print_results`` look them up by name at call time):

``training_log`` (called every iteration, on every rank). On iterations where Megatron prints its
line (``iteration % log_interval == 0`` or the first), and on every iteration when
``--tah-log-json`` is given, the wrapper -- on every rank, the reduction is collective over the
pipeline group -- takes this rank's counters (``REGISTRY.stats.collect``), sums them on the pipeline's
last rank (``stats.reduce_to_last_rank``) and, on the last rank of the job:

1. appends one JSON record per iteration to ``--tah-log-json``::

       {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "skipped", "ms", "tokens_per_s",
        "fwd_raw_bytes", "fwd_wire_bytes", "bwd_raw_bytes", "bwd_wire_bytes", "compression_ratio",
        "codec_ms", "buffer_bytes", "tah": {stream: {...reduced statistics...}},
        "link_rel_error": {"src->dst": mean sampled round-trip error of that pipeline link}, "saved_memory",
        "auto": {"src->dst": {"codec", "rate_bps", "spread_bps"}: auto's codec and measured rate per link},
        "wan_bytes", "wan_codec_bytes", "wan": {category: {"ops", "bytes", "codec_bytes"}},
        "places": {place: {name: value}}}

   ``lm_loss`` is this iteration's loss (Megatron's printed value averages since the last reset),
   ``ms`` the wall time since the previous iteration's record (None for the first), bytes and
   ``codec_ms`` (encode + decode time) are this iteration's, summed over the pipeline's stages
   (``fwd_*``/``bwd_*`` and ``compression_ratio``: the pipeline's; ``tah`` has every stream of
   ``places.streams()``); ``saved_memory`` is LAAQ's per-stage peak ({} without it); ``wan_bytes`` the WAN
   ledger's bytes (everything that crossed a stage boundary, summed over the pipeline's stages: ``ledger.py``
   says how each operation is billed), ``wan_codec_bytes`` the part that went through a codec, ``wan`` per
   category (``stats.WAN_CATEGORIES``); ``places`` the levels of each installed place's ``statistics`` hook,
   summed over the stages;
2. on printing iterations, appends ``stats.format_for_log`` of the training traffic since the
   previous line, per iteration (``tah fwd MB/iter``, ``tah codec ms/iter``: divided by the
   iterations since that line, as Megatron divides its own items; like Megatron's, the first
   iteration's line does not start a new span), to the iteration line Megatron prints, and writes
   the same as scalars to the TensorBoard and wandb writers: ``tah/<stream>_<count>_per_iter``
   (messages, raw_bytes, wire_bytes) and ``tah/<stream>_<mean>`` (ratio, rel_error,
   rotated_fraction), and ``tah/<place>_<name>`` for a place's own levels. Streams of the pipeline always;
   ``tp_*`` / ``dp_*`` only while that place is installed (``REGISTRY.places``). The line starts with the WAN ledger (`` wan MB/iter: 25.918 | wan
   compressed: 0.7% |``) and the scalars carry it as ``tah/wan_bytes_per_iter``,
   ``tah/wan_codec_bytes_per_iter`` and ``tah/wan_<category>_bytes_per_iter``.

``evaluate`` / ``evaluate_and_print_results``: an evaluation's traffic is counted apart
(``Stats.apart``), never in the training items: the last rank prints it as its own line
(`` evaluation tah traffic at iteration 4 | tah fwd MB: ... |``, totals of the evaluation) and
appends ``{"iteration", "valid_loss", "valid_ppl", "valid_fwd_wire_bytes"}`` (``test_*`` for the test set),
plus ``valid_loss_uncompressed`` with ``--tah-eval-traffic both`` (``evaluate`` then runs twice, on the
same batches; the bytes of both passes count), plus every other metric the forward step reports, as
``valid_<name>`` (``python -m megatron_tah.pretrain_gpt --eval-token-accuracy``: ``valid_token_accuracy``).

``check_log_json`` (run by the ``--tah-*`` validation hook, ``arguments.py``) rejects a
``--tah-log-json`` path that cannot be appended to before anything is built.

Records are appended: a run resumed from a checkpoint continues the same file.
``uninstall_logging()`` restores the three functions exactly (recorded in ``registry.REGISTRY.logging``;
the pending counters are ``REGISTRY.log``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from typing import Any

from . import pipeline_parallel, places, stats
from .patching import Patches, resolve
from .registry import REGISTRY

TRAINING = "megatron.training.training"
DIRECTIONS = stats.DIRECTIONS
PER_ITERATION_KEYS = ("messages", "raw_bytes", "wire_bytes")  # scalars tah/<stream>_<key>_per_iter
MEAN_KEYS = ("ratio", "rel_error", "rotated_fraction")  # scalars tah/<stream>_<key>
# training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
#              skipped_iter, grad_norm, ..., is_first_iteration=...)
_POSITIONS = {"loss_dict": 0, "learning_rate": 2, "iteration": 3, "skipped_iter": 6, "grad_norm": 7,
              "is_first_iteration": 12}
# evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration, ...)
_EVAL_POSITIONS = {"prefix": 0, "iteration": 4}
_EVALUATE_POSITIONS = {"data_iterator": 1}  # evaluate(forward_step_func, data_iterator, model, ...)


class LogState:
    """What the log keeps between calls (``REGISTRY.log`` while installed)."""

    def __init__(self):
        self.since_line = None  # reduced training statistics since the last printed line
        self.iterations_since_line = 0  # training_log calls (iterations, skipped ones included) they cover
        self.last_record_time = None
        self.evaluations: list[dict] = []  # losses of the evaluations run by the current evaluate_and_print_results


def _argument(args: tuple, kwargs: dict, name: str, positions: dict, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    position = positions[name]
    return args[position] if len(args) > position else default


def _replace_argument(args: tuple, kwargs: dict, name: str, positions: dict, value: Any) -> tuple[tuple, dict]:
    if name in kwargs or len(args) <= positions[name]:
        return args, {**kwargs, name: value}
    position = positions[name]
    return (*args[:position], value, *args[position + 1:]), kwargs


def _number(value) -> float | None:
    if value is None:
        return None
    value = float(value.item() if hasattr(value, "item") else value)
    return value if math.isfinite(value) else None


def streams_on() -> tuple[str, ...]:
    """The ``places.streams()`` keys to report: an always-on place's (the pipeline's) always, the others' while
    installed."""
    return tuple(stream.key for stream in places.streams()
                 if places.PLACES[stream.place].option is None or stream.place in REGISTRY.places)


def scalars(reduced: dict, iterations: int = 1, streams: tuple[str, ...] | None = None) -> dict[str, float]:
    """Flatten the reduced statistics of ``iterations`` iterations into ``{"tah/forward_wire_bytes_per_iter":
    1.2e6, "tah/forward_ratio": 3.6, ...}`` for ``streams`` (None: every stream of ``reduced``), skipping
    missing/NaN values, and each place's own levels (``tah/<place>_<name>``)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    out = {}
    for stream in stats.stream_keys(reduced) if streams is None else streams:
        for key in (*PER_ITERATION_KEYS, *MEAN_KEYS):
            value = reduced.get(stream, {}).get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                name = f"tah/{stream}_{key}_per_iter" if key in PER_ITERATION_KEYS else f"tah/{stream}_{key}"
                out[name] = float(value) / iterations if key in PER_ITERATION_KEYS else float(value)
    wan, codec = stats.wan_totals(reduced)
    if "wan" in reduced:
        out["tah/wan_bytes_per_iter"] = wan / iterations
        out["tah/wan_codec_bytes_per_iter"] = codec / iterations
        for category, sums in reduced["wan"].items():
            out[f"tah/wan_{category}_bytes_per_iter"] = sums["bytes"] / iterations
    for place, values in reduced.get("places", {}).items():
        out.update({f"tah/{place}_{name}": float(value) for name, value in values.items()})
    return out


def write_scalars(reduced: dict, iteration: int, writer=None, wandb_writer=None, iterations: int = 1,
                  streams: tuple[str, ...] | None = None) -> dict[str, float]:
    """Write ``scalars(reduced, iterations, streams)`` to a TensorBoard ``SummaryWriter`` and/or a wandb run
    (either may be None)."""
    values = scalars(reduced, iterations, streams)
    if writer is not None:
        for name, value in values.items():
            writer.add_scalar(name, value, iteration)
    if wandb_writer is not None and values:
        wandb_writer.log(values, iteration)
    return values


def iteration_record(margs, iteration: int, reduced: dict, loss_dict: dict, learning_rate, grad_norm,
                     skipped: bool, seconds: float | None) -> dict:
    """The JSON record of one training iteration (see the module docstring)."""
    fwd, bwd = reduced["forward"], reduced["backward"]
    raw, wire = fwd["raw_bytes"] + bwd["raw_bytes"], fwd["wire_bytes"] + bwd["wire_bytes"]
    streams = stats.stream_keys(reduced)
    loss = loss_dict.get("lm loss") if loss_dict else None
    tokens = margs.global_batch_size * margs.seq_length
    return {
        "iteration": int(iteration),
        "consumed_samples": int(getattr(margs, "consumed_train_samples", 0)),
        "lm_loss": _number(loss),
        "lr": _number(learning_rate),
        "grad_norm": _number(grad_norm),
        "skipped": bool(skipped),
        "ms": None if seconds is None else 1e3 * seconds,
        "tokens_per_s": None if not seconds else tokens / seconds,
        "fwd_raw_bytes": fwd["raw_bytes"], "fwd_wire_bytes": fwd["wire_bytes"],
        "bwd_raw_bytes": bwd["raw_bytes"], "bwd_wire_bytes": bwd["wire_bytes"],
        "compression_ratio": raw / wire if wire else None,
        "codec_ms": 1e3 * sum(reduced[d]["encode_seconds"] + reduced[d]["decode_seconds"] for d in streams),
        "buffer_bytes": int(reduced.get("buffer_bytes", 0)),
        "tah": {d: reduced[d] for d in streams},
        "link_rel_error": stats.link_rel_errors(reduced),
        "saved_memory": {str(rank): peaks for rank, peaks in reduced.get("saved_memory", {}).items()},
        "auto": {f"{src}->{dst}": item for (src, dst), item in sorted(reduced.get("auto", {}).items())},
        "wan_bytes": stats.wan_totals(reduced)[0], "wan_codec_bytes": stats.wan_totals(reduced)[1],
        "wan": reduced.get("wan", {}),
        "places": reduced.get("places", {}),
    }


def check_log_json(path: str | None) -> None:
    """Raise ``ValueError`` naming ``--tah-log-json`` unless records can be appended to ``path``: a writable
    file, or a new one under a writable folder (missing folders are created at the first record). None: no log."""
    if path is None:
        return
    if not path or os.path.isdir(path):
        raise ValueError(f"--tah-log-json {path or repr(path)}: give a file to append records to, not a folder")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"--tah-log-json {path}: the file is not writable")
        return
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"--tah-log-json {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--tah-log-json {path}: cannot create it in {folder} (not writable)")


def append_json(path: str, record: dict) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_records(path: str) -> list[dict]:
    """The training records of a ``--tah-log-json`` file, one per iteration, each evaluation's keys
    (``valid_loss``, ``valid_ppl``...) merged into the record of the iteration it followed (or making one, when
    no training record has that iteration: an evaluation without training); a later record of the same
    iteration (a resumed run) replaces the earlier one."""
    training: dict[int, dict] = {}
    evaluations: list[dict] = []
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if "lm_loss" not in record and ("valid_loss" in record or "test_loss" in record):
                    evaluations.append(record)
                else:
                    training[record["iteration"]] = record
    for evaluation in evaluations:  # an evaluation with no training record (--skip-train): a record of its own
        training.setdefault(evaluation["iteration"], {"iteration": evaluation["iteration"]}).update(evaluation)
    return [training[i] for i in sorted(training)]


def _is_iteration_line(message: Any) -> bool:
    return isinstance(message, str) and " iteration " in message and "consumed samples" in message


def _call_appending(original, args, kwargs, fragment: str, iteration: int):
    """Run ``training_log`` with ``fragment`` added to the first iteration line it prints."""
    patches = Patches()
    appended = []
    module = resolve(TRAINING)
    printer = module.print_rank_last

    def print_rank_last(message, *p_args, **p_kwargs):
        if not appended and _is_iteration_line(message):
            appended.append(True)
            message = message + fragment
        return printer(message, *p_args, **p_kwargs)

    patches.replace(module, "print_rank_last", print_rank_last,
                    why="the iteration line gets the tah columns, during one call")
    try:
        result = original(*args, **kwargs)
    finally:
        patches.restore()
    if not appended and fragment:
        printer(f" iteration {iteration:8d} |{fragment}")
    return result


def _logging_training_log(original):
    def training_log(*args, **kwargs):
        from megatron.training.global_vars import get_args, get_tensorboard_writer, get_wandb_writer
        from megatron.training.utils import is_last_rank

        margs = get_args()
        iteration = _argument(args, kwargs, "iteration", _POSITIONS)
        first = bool(_argument(args, kwargs, "is_first_iteration", _POSITIONS, False))
        printing = iteration is not None and (iteration % margs.log_interval == 0 or first)
        json_path = getattr(margs, "tah_log_json", None)
        log = REGISTRY.log
        log.iterations_since_line += 1
        if iteration is None or not (printing or json_path):
            return original(*args, **kwargs)

        reduced = stats.reduce_to_last_rank(REGISTRY.stats.collect(reset=True), config=REGISTRY.config)
        log.since_line = stats.merge(log.since_line, reduced)
        now = time.monotonic()
        if json_path and is_last_rank():
            seconds = None if log.last_record_time is None else now - log.last_record_time
            record = iteration_record(
                margs, iteration, reduced, _argument(args, kwargs, "loss_dict", _POSITIONS, {}),
                _argument(args, kwargs, "learning_rate", _POSITIONS), _argument(args, kwargs, "grad_norm", _POSITIONS),
                bool(_argument(args, kwargs, "skipped_iter", _POSITIONS, 0)), seconds)
            append_json(json_path, record)
        log.last_record_time = now
        if not printing:
            return original(*args, **kwargs)
        since_line, iterations, streams = log.since_line, log.iterations_since_line, streams_on()
        if not first:  # Megatron's first line does not reset its interval either
            log.since_line, log.iterations_since_line = None, 0
        write_scalars(since_line, iteration, get_tensorboard_writer(), get_wandb_writer(), iterations, streams)
        return _call_appending(original, args, kwargs, REGISTRY.stats.format_for_log(since_line, iterations, streams),
                               iteration)

    return training_log


def _two_iterators(data_iterator):
    """Two iterators yielding what ``data_iterator`` yields (a list of them for virtual pipeline stages;
    None, a stage that reads no data, stays None)."""
    if data_iterator is None:
        return None, None
    if isinstance(data_iterator, list):
        pairs = [_two_iterators(it) for it in data_iterator]
        return [a for a, _ in pairs], [b for _, b in pairs]
    return itertools.tee(_items(data_iterator))


def _items(iterator):
    """What ``next(iterator)`` returns, as a generator (Megatron's RerunDataIterator has no ``__iter__``)."""
    while True:
        try:
            yield next(iterator)
        except StopIteration:
            return


def _recording_evaluate(original):
    """Megatron's ``evaluate`` run per ``--tah-eval-traffic`` inside ``pipeline_parallel.evaluation`` (every stage
    evaluates together, so both ends of each link switch), its losses recorded for the JSON log. With
    ``both``, a second pass over the same batches, uncompressed, adds ``"<name> uncompressed"`` losses
    (the batches count once in ``consumed_valid_samples``)."""
    def evaluate(*args, **kwargs):
        from megatron.training.global_vars import get_args

        config = REGISTRY.config
        traffic = config.tah_eval_traffic if config is not None else "codec"
        again = None
        if traffic == "both":
            first, second = _two_iterators(_argument(args, kwargs, "data_iterator", _EVALUATE_POSITIONS))
            args, kwargs = _replace_argument(args, kwargs, "data_iterator", _EVALUATE_POSITIONS, first)
            again = _replace_argument(args, kwargs, "data_iterator", _EVALUATE_POSITIONS, second)
        with pipeline_parallel.evaluation(uncompressed=traffic == "uncompressed"):
            result = original(*args, **kwargs)
        losses = {k: _number(v) for k, v in ((result or [None])[0] or {}).items()}
        if again is not None:
            margs = get_args()
            consumed = margs.consumed_valid_samples
            with pipeline_parallel.evaluation(uncompressed=True):
                raw = original(*again[0], **again[1])
            margs.consumed_valid_samples = consumed
            losses.update({f"{k} uncompressed": _number(v) for k, v in ((raw or [None])[0] or {}).items()})
        if result:
            REGISTRY.log.evaluations.append(losses)
        return result

    return evaluate


def _logging_evaluation(original):
    def evaluate_and_print_results(*args, **kwargs):
        from megatron.training.global_vars import get_args
        from megatron.training.utils import is_last_rank

        log = REGISTRY.log
        log.evaluations = []
        # The evaluation's traffic (forward only) is its own: counted apart from the training traffic
        # not yet collected, reduced (collective over the pipeline group, like training_log's) and reported
        # on its own line and record.
        with REGISTRY.stats.apart():
            result = original(*args, **kwargs)
            reduced = stats.reduce_to_last_rank(REGISTRY.stats.collect(reset=True), config=REGISTRY.config)
        prefix = _argument(args, kwargs, "prefix", _EVAL_POSITIONS, "")
        fragment = REGISTRY.stats.format_for_log(reduced, None, streams_on())
        if fragment:
            resolve(TRAINING).print_rank_last(f" evaluation tah traffic at {prefix} |{fragment}")
        json_path = getattr(get_args(), "tah_log_json", None)
        if json_path and is_last_rank():
            split = "test" if "test" in str(prefix) else "valid"
            iteration = _argument(args, kwargs, "iteration", _EVAL_POSITIONS)
            for losses in log.evaluations:
                loss = losses.get("lm loss")
                if loss is not None:
                    record = {"iteration": int(iteration), f"{split}_loss": loss,
                              f"{split}_ppl": math.exp(min(20.0, loss)),
                              f"{split}_fwd_wire_bytes": reduced["forward"]["wire_bytes"]}
                    if losses.get("lm loss uncompressed") is not None:  # --tah-eval-traffic both
                        record[f"{split}_loss_uncompressed"] = losses["lm loss uncompressed"]
                    for key, value in losses.items():  # the forward step's other metrics, e.g. "token accuracy"
                        if not key.startswith("lm loss") and value is not None:
                            record[f"{split}_{key.replace(' ', '_')}"] = value
                    append_json(json_path, record)
        log.evaluations = []
        return result

    return evaluate_and_print_results


def install_logging() -> None:
    """Wrap ``training_log``, ``evaluate`` and ``evaluate_and_print_results`` (idempotent)."""
    patches = REGISTRY.logging
    if patches:
        return
    REGISTRY.log = LogState()
    REGISTRY.stats.declare(places.streams())  # every stream is in the records, installed or not
    patches.wrap(TRAINING, "training_log", _logging_training_log,
                 why="the statistics in the log line, TensorBoard/wandb and --tah-log-json")
    patches.wrap(TRAINING, "evaluate", _recording_evaluate, why="evaluations' traffic per --tah-eval-traffic")
    patches.wrap(TRAINING, "evaluate_and_print_results", _logging_evaluation,
                 why="the evaluation's traffic on its own line and in --tah-log-json")


def uninstall_logging() -> None:
    """Restore the original functions (no-op when not installed) and forget pending counters."""
    REGISTRY.logging.restore()
    REGISTRY.log = None
