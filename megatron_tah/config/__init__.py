"""megatron_tah's options: ``TahConfig`` (``tah_config.py``), the source of the ``--tah-*`` flags; how a field
declares its valid values (``fields.py``); what the pipeline's fields must satisfy (``pipeline.py``);
``--tah-preset``'s presets (``presets.py``); ``auto``'s settings and candidates (``auto.py``).

Imports the codecs and nothing above them: the link and the Megatron patches read a ``TahConfig``.
"""

from .auto import (AUTO, CANDIDATES, DEFAULT_CANDIDATES, NON_PRESET, AutoSettings, candidate_description,
                   candidate_fields)
from .fields import CODEC_OPTIONS, codec_option
from .presets import PRESETS, Preset
from .tah_config import TahConfig, candidate_codec

__all__ = ["AUTO", "CANDIDATES", "CODEC_OPTIONS", "DEFAULT_CANDIDATES", "NON_PRESET", "PRESETS", "AutoSettings",
           "Preset", "TahConfig", "candidate_codec", "candidate_description", "candidate_fields", "codec_option"]
