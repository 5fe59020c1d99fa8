"""megatron_tah/codecs: each codec, the registry, the generic tests every registered codec runs through."""
