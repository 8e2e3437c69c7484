"""nlq-scale: do nonlinear query projections in attention keep winning as models grow?

The public API (docs/api.md): load_config, build_model, count_parameters. They are imported on
first use, so `import nlq_scale` stays cheap."""

import sys

if sys.version_info[:2] != (3, 12):  # what is tested, and what megatron-core 0.19 ships wheels for
    raise ImportError(
        f"nlq-scale needs Python 3.12, not {sys.version.split()[0]}: `make setup` builds its venv with "
        "python3.12 (or PYTHON=/path/to/python3.12)"
    )

from nlq_scale.compat.megatron_jit import defer_jit_fuser  # noqa: E402 - after the version check

# before any module of the package imports megatron.core (compat/megatron_jit.py says why)
defer_jit_fuser()

__version__ = "0.1.0"
__all__ = ["build_model", "count_parameters", "load_config"]


def __getattr__(name: str):
    if name in __all__:
        from nlq_scale import api

        return getattr(api, name)
    raise AttributeError(f"module 'nlq_scale' has no attribute {name!r}")
