"""megatron_tah/megatron and the entry points: places, patches, the parallel layouts, arguments, training runs."""
