"""``none``: the tensor's raw bytes behind the header (bit-exact, the uncompressed baseline).

Wire: header | ``values``: the input's elements in its own dtype, row-major.
"""

from __future__ import annotations

import math

import torch

from .base import Codec, register_codec_id
from .options import CodecDeclaration

DECLARATION = CodecDeclaration(kernel=False)


class NoneCodec(Codec):
    name = "none"
    codec_id = 0

    def __init__(self, backend: str = "auto"):
        super().__init__(backend)

    def config(self) -> dict:
        return {}

    def _sections(self, shape, dtype):
        return [("values", math.prod(shape) * dtype.itemsize)]

    def _encode_torch(self, x, buf, layout):
        layout.view(buf, "values").copy_(x.reshape(-1).view(torch.uint8))

    def _decode_torch(self, buf, shape, dtype, layout):
        return layout.view(buf, "values", dtype).reshape(shape).clone()


register_codec_id(NoneCodec.codec_id, NoneCodec.name)
