"""When a transfer is complete, and how long it took, whatever the backend.

A NCCL ``Work``'s ``wait()`` returns once its kernel is queued (it only makes the current stream wait
for the NCCL stream), so a host clock read around it times the launch; and a later host read of the
received data waits for everything queued before it on the current stream too (the receiver's
compute). A gloo ``Work``'s ``wait()`` returns when the transfer is done (and a gloo receive reads as
complete only once waited for). Two ways to the transfer's own time on both:

* ``wait_completed(work, wait)`` waits through ``wait`` (the caller's bounded wait, ``peer.PeerWatch``; gloo:
  the transfer is done; it raises the work's error, if any), then polls ``is_completed()`` (NCCL: the work's
  end event on the device) until it is: a host clock read right after it is the completion time, to within
  one poll.
* ``time_works(group)`` turns on a NCCL group's own timing of its works
  (``ProcessGroup._enable_collectives_timing``: a CUDA event before and after each kernel on the NCCL
  stream; it applies to works posted afterwards); ``work_seconds(work)`` reads a complete timed work's
  duration (``Work._get_duration()``, milliseconds). Other backends keep their works untimed
  (``time_works`` is False): their transfers are timed on the host.
"""

from __future__ import annotations

import time

import torch

__all__ = ["time_works", "wait_completed", "work_seconds"]


def wait_completed(work, wait) -> None:
    """Return once ``work``'s transfer is complete, whatever the backend: ``wait(work)`` (gloo; the caller's
    bounded wait of ``work.wait()``), then ``is_completed()`` polled (NCCL); raises what ``wait`` raises."""
    wait(work)
    while not work.is_completed():
        time.sleep(0)  # (lets other Python threads run; the poll itself is a CUDA event query on NCCL)


def time_works(group) -> bool:
    """Whether the works posted on ``group`` from now on time themselves: True on a NCCL group (its timing
    is turned on here; idempotent), False elsewhere."""
    if torch.distributed.get_backend(group) != "nccl":
        return False
    enable = getattr(group, "_enable_collectives_timing", None)
    if enable is None:  # (a torch without it: the host's timing stands)
        return False
    enable()
    return True


def work_seconds(work) -> float | None:
    """The seconds a complete work posted with ``time_works`` took on the device (its kernel's start to
    its end on the NCCL stream), None where the backend did not time it."""
    try:
        milliseconds = float(work._get_duration())
    except (AttributeError, RuntimeError):  # untimed, or a backend without durations (gloo)
        return None
    return milliseconds / 1e3 if milliseconds > 0 else None
