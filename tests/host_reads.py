"""``no_host_reads()``: fail on any Python-level read of a tensor's values by the host.

On a GPU each of these is a device-to-host copy and a sync, which a CUDA graph cannot capture; on
the CPU they are the same calls, so a test that runs a codec's path under this context on the CPU
fails wherever the GPU path would sync (torch.cuda.set_sync_debug_mode needs a GPU).

``FakeGraphs`` stands in for ``codecs.graphs.CudaGraphs`` on the CPU: a capture runs the call once (the
warm-up), a replay runs it again under ``no_host_reads``.
"""

import contextlib

import torch

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def forbid(name):
        def read(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name} called: a host read (a sync on a GPU)")
        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, forbid(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


class FakeGraphs:
    """Capture = the warm-up call; replay = the call again, failing on any host read (unless ``strict=False``)."""

    def __init__(self, strict=True):
        self.captures = 0
        self.replays = 0
        self.strict = strict

    def unavailable(self, device):
        return None

    def capture(self, fn, device):
        fn()
        self.captures += 1

        def replay():
            self.replays += 1
            if not self.strict:
                return fn()
            with no_host_reads():
                fn()

        return replay
