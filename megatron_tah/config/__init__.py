"""megatron_tah's options: ``TahConfig`` (``tah_config.py``), the source of the ``--tah-*`` flags;
``--tah-preset``'s presets (``presets.py``); ``auto``'s settings (``auto.py``).

Imports the codecs and nothing above them: the link and the Megatron patches read a ``TahConfig``.
"""

from .auto import AUTO, CANDIDATES, DEFAULT_CANDIDATES, NON_PRESET, AutoSettings
from .presets import PRESETS
from .tah_config import CODEC_OPTIONS, TahConfig, candidate_codec, codec_option

__all__ = ["AUTO", "CANDIDATES", "CODEC_OPTIONS", "DEFAULT_CANDIDATES", "NON_PRESET", "PRESETS", "AutoSettings",
           "TahConfig", "candidate_codec", "codec_option"]
