"""Engines (megatron, DeepSpeed), the train loop, schedules, checkpoints and metrics."""
