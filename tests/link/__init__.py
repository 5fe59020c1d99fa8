"""megatron_tah/link: the pipeline transport, staging, the handshake, frames on the wire, auto, peer timeouts."""
