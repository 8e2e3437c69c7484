"""torch.distributed + megatron parallel_state setup, and the CPU shim for megatron-core."""
