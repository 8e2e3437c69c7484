"""The small, stable Python API (docs/api.md): load a run config, build its model in this process,
count its parameters. `import nlq_scale` stays cheap: torch and megatron load on first build."""

from __future__ import annotations

from collections.abc import Iterable

from nlq_scale import arms
from nlq_scale.config.load import find_config, load_run_config
from nlq_scale.config.schema import ModelConfig, ParallelConfig, RunConfig
from nlq_scale.model.accounting import ParamCount
from nlq_scale.model.accounting import count_parameters as _count


def load_config(scale: str | None, arm: str | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """A validated run config: scale <- arm <- `key=value` overrides. `arm` is a configs/arms name
    (e.g. linear-mlp4.75) or a registered arm without a config file (e.g. one from $NLQ_SCALE_ARMS)."""
    overrides = list(overrides)
    if arm is not None and find_config("arms", arm) is None and arm in arms.names():
        arm, overrides = None, [f"model.arm={arm}", *overrides]
    return load_run_config(scale=scale, arm=arm, overrides=overrides)


def count_parameters(cfg: RunConfig | ModelConfig) -> ParamCount:
    """Exact parameter counts (total, non-embedding, embedding, per layer) without building the model."""
    return _count(cfg.model if isinstance(cfg, RunConfig) else cfg)


def build_model(cfg: RunConfig):
    """The megatron-core GPT of `cfg`, whole, in this process (tensor/pipeline parallel size 1; CPU
    works). Initialises a one-rank process group and megatron's parallel state unless they exist."""
    from megatron.core import parallel_state as ps

    from nlq_scale.model.gpt import build_gpt, seed_init
    from nlq_scale.runtime.dist import DistEnv, init_distributed

    single = ParallelConfig()
    if not ps.model_parallel_is_initialized():
        init_distributed(DistEnv(0, 1, 0, 1, "127.0.0.1", 0), single)
    seed_init(cfg.seed)
    return build_gpt(cfg.model, single)
