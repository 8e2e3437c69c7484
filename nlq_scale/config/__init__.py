"""pydantic run configuration and YAML loading with dotted overrides."""

from nlq_scale.config.load import (
    CONFIG_DIR,
    available,
    build_run_config,
    dump_run_config,
    load_run_config,
    parse_overrides,
    read_yaml,
)
from nlq_scale.config.schema import ARMS, RunConfig

__all__ = [
    "ARMS",
    "CONFIG_DIR",
    "RunConfig",
    "available",
    "build_run_config",
    "dump_run_config",
    "load_run_config",
    "parse_overrides",
    "read_yaml",
]
