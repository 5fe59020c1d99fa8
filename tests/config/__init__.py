"""megatron_tah/config: TahConfig's own checks (its flags on Megatron's parser: tests/megatron)."""
