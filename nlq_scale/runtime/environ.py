"""Environment variables set for one block only."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """os.environ with `values` set (None: removed) inside the block, as it was again on exit."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _put(name, value)
        yield
    finally:
        for name, value in saved.items():
            _put(name, value)


def _put(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
