"""Codecs for pipeline tensors: one contract (see ``core.base.Codec``), one file per codec.

>>> from megatron_tah.codecs import get_codec
>>> codec = get_codec("tah", tile_size=64, high_bits=4, low_bits=3, high_ratio=0.8, outlier_threshold=2.0)
>>> buf = codec.encode(x)                       # 1-D uint8, codec.wire_nbytes(x.shape, x.dtype) bytes
>>> y = codec.decode(buf, x.shape, x.dtype)     # or codec.decode(buf, shape, dtype, out=t)
"""

from __future__ import annotations

import importlib

from .core.base import Codec
from .core.errors import CodecError, PayloadChecksumError, WireFormatError
from .core.options import CodecDeclaration, Option

# The registry: name -> "module:Class", one line per codec, in the order flags and tables list them. A module
# starting with "." is one of this package's (".none" is ``megatron_tah.codecs.none``); any other is imported by
# its full name. Each module starts with its ``DECLARATION`` (options and capabilities, see ``core/options.py``) and
# registers its ``codec_id``; modules are imported on first use. Everything that lists codecs (the --tah-*
# flags and their table, the codec table, the generic tests) reads this dict when it runs.
CODECS = {
    "none": ".none:NoneCodec",
    "fixedpoint": ".fixedpoint:FixedPointCodec",
    "tah": ".tah:TahCodec",
    "fp8": ".fp8:Fp8Codec",
    "aqsgd": ".aqsgd:AqSgdCodec",
    "int8": ".int8:Int8Codec",
    "mxfp4": ".mxfp4:MxFp4Codec",
    "nvfp4": ".nvfp4:NvFp4Codec",
    "hadint": ".hadint:HadIntCodec",
    "lowrank": ".lowrank:LowRankCodec",
    "channel": ".channel:ChannelCodec",
}


def _module(name: str):
    if name not in CODECS:
        raise CodecError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    return importlib.import_module(CODECS[name].split(":")[0], __name__)


def codec_class(name: str) -> type[Codec]:
    """The class registered as codec ``name`` (its module imported on first use)."""
    return getattr(_module(name), CODECS[name].split(":")[1])


def codec_declaration(name: str) -> CodecDeclaration:
    """The options and capabilities codec ``name`` declares at the top of its file."""
    return _module(name).DECLARATION


def get_codec(name: str, **config) -> Codec:
    """A new codec object of kind ``name`` with the given options (see each codec's class)."""
    cls = codec_class(name)
    try:
        return cls(**config)
    except TypeError as err:
        raise CodecError(f"codec {name!r}: {err}") from None


def load_all_codecs() -> None:
    """Import every codec module (registers the ids used in wire-format error messages)."""
    for name in CODECS:
        codec_class(name)


__all__ = ["CODECS", "Codec", "CodecDeclaration", "CodecError", "Option", "PayloadChecksumError", "WireFormatError",
           "codec_class", "codec_declaration", "get_codec", "load_all_codecs"]
