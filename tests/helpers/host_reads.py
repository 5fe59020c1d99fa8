"""``no_host_reads()``: fail on any Python-level read of a tensor's values by the host.

On a GPU each of these is a device-to-host copy and a sync, which a CUDA graph cannot capture; on
the CPU they are the same calls, so a test that runs a codec's path under this context on the CPU
fails wherever the GPU path would sync (torch.cuda.set_sync_debug_mode needs a GPU). Tensors built
from host data (``torch.tensor``) fail too: on a GPU each is a copy from pageable memory, which a
capture refuses.

``FakeGraphs`` stands in for ``codecs.core.graphs.CudaGraphs`` on the CPU: a capture runs the call once (the
warm-up), a replay runs it again under ``no_host_reads``.
"""

import contextlib

import torch

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
HOST_BUILT = ("tensor", "as_tensor")  # torch.tensor(data, device=cuda): a pageable host-to-device copy


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    """Also fails on ``torch.tensor`` / ``torch.as_tensor``: a tensor built from host data is, on a GPU, a
    copy from pageable memory (a sync with the torch backend, refused inside a CUDA graph capture)."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    saved_built = {name: getattr(torch, name) for name in HOST_BUILT}

    def forbid(name):
        def read(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name} called: a host read (a sync on a GPU)")
        return read

    def forbid_built(name):
        def build(*args, **kwargs):
            raise HostRead(f"torch.{name} called: a tensor built on the host (a pageable copy to a GPU)")
        return build

    try:
        for name in READS:
            setattr(torch.Tensor, name, forbid(name))
        for name in HOST_BUILT:
            setattr(torch, name, forbid_built(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        for name, function in saved_built.items():
            setattr(torch, name, function)


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
