"""``none``: the tensor's raw bytes behind the header (bit-exact, the uncompressed baseline).

Wire: header | ``values``: the input's elements in its own dtype, row-major.
"""

from __future__ import annotations

import math

import torch

from .core.base import CHECKSUM_DEFAULT, Codec
from .core.header import register_codec_id
from .core.options import CodecDeclaration

DECLARATION = CodecDeclaration(kernel=False)


class NoneCodec(Codec):
    name = "none"
    codec_id = 0
    graph_no_gain = "one copy each way: a replay would add a copy in and a copy out"

    def __init__(self, backend: str = "auto", checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(backend, checksum)

    def config(self) -> dict:
        return {}

    def _sections(self, shape, dtype):
        return [("values", math.prod(shape) * dtype.itemsize)]

    def _encode_torch(self, x, buf, layout):
        layout.view(buf, "values").copy_(x.reshape(-1).view(torch.uint8))

    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        values = layout.view(buf, "values", dtype).reshape(shape)
        return values.clone() if out is None else out.copy_(values)  # one copy either way


register_codec_id(NoneCodec.codec_id, NoneCodec.name)
