"""``no_host_reads()``: fail on any Python-level read of a tensor's values by the host.

On a GPU each of these is a device-to-host copy and a sync, which a CUDA graph cannot capture; on
the CPU they are the same calls, so a test that runs a codec's path under this context on the CPU
fails wherever the GPU path would sync (torch.cuda.set_sync_debug_mode needs a GPU).
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
