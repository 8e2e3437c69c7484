"""Query variants as megatron-core ModuleSpecs, the GPT builder, accounting, and a plain-PyTorch reference."""
