"""Codec time and statistics that stay on the device until they are read.

On a GPU a codec call returns as soon as its kernels are queued, so ``time.perf_counter``
around it measures the launch, and turning a device tensor into a float waits for every queued
kernel. The helpers here keep such numbers pending and resolve them when a log line needs them:

* ``Stopwatch(device)`` times a call: CUDA events on a CUDA device (the kernels' own time on that
  device's current stream, whichever device is current), ``perf_counter`` elsewhere. ``stop()`` returns the elapsed seconds as a float on the
  CPU, or as a pending ``Interval`` on CUDA.
* ``relative_error(x, y)``: ``||x - y|| / ||x||`` as a 0-d device tensor (0 for ``x = 0``).
* ``add(total, value)`` sums floats, 0-d tensors and intervals without waiting (a ``Pending``
  sum when anything is not a float yet); ``to_float`` resolves any of them (the one sync).
"""

from __future__ import annotations

import time

import torch


class Interval:
    """Seconds between two recorded CUDA events, read when asked for."""

    def __init__(self, start, end):
        self.start, self.end = start, end

    def __float__(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class Stopwatch:
    """``Stopwatch(device)`` then ``stop()``: seconds since construction (float, or ``Interval`` on CUDA)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(torch.cuda.current_stream(self.device))
        else:
            self.start = time.perf_counter()

    def stop(self) -> float | Interval:
        if not self.cuda:
            return time.perf_counter() - self.start
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        return Interval(self.start, end)


class Pending:
    """A sum of floats, 0-d tensors and ``Interval``s, resolved by ``float()``."""

    def __init__(self, total: float = 0.0, items: tuple = ()):
        self.total = total
        self.items = list(items)

    def __add__(self, value):
        return add(self, value)

    __radd__ = __add__

    def __float__(self) -> float:
        return self.total + sum(to_float(item) for item in self.items)


def add(total, value):
    """``total + value`` without waiting for the device: a float when both are floats, else a ``Pending``."""
    if value is None:
        return total
    if isinstance(value, (int, float)) and isinstance(total, (int, float)):
        return float(total) + float(value)
    if isinstance(value, torch.Tensor):
        value = value.detach()
    result = Pending(total.total, total.items) if isinstance(total, Pending) else Pending(float(total))
    if isinstance(value, Pending):
        result.total += value.total
        result.items += value.items
    elif isinstance(value, (int, float)):
        result.total += float(value)
    else:
        result.items.append(value)
    return result


def to_float(value) -> float:
    """A float from a number, a tensor (waits for the device), an ``Interval`` or a ``Pending`` sum."""
    if isinstance(value, torch.Tensor):
        return float(value.float().sum())
    return float(value)


def relative_error(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``||x - y|| / ||x||`` in fp32 as a 0-d tensor on x's device, 0 when ``x`` is all zeros (no sync)."""
    x = x.detach().float()
    norm = x.norm()
    error = (x - y.detach().float()).norm()
    return torch.where(norm > 0, error / torch.where(norm > 0, norm, torch.ones_like(norm)), torch.zeros_like(norm))
