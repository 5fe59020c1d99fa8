"""megatron_tah/megatron: places, patches, the parallel layouts, arguments, training runs through them (the entry
points' own tests sit beside their names in tests/)."""
