"""Leave a process quickly once its work is done."""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """sys.exit(code) without the interpreter's final garbage collections over every object that
    torch, transformers and mosaicml-streaming created: measured here they are ~1.1 s of the ~1.4 s a
    process that imported them takes to exit, paid by every CLI call, rank and job. `gc.freeze` puts
    the survivors out of the collector's reach; atexit handlers, stream flushing and module teardown
    still run as usual."""
    gc.freeze()
    sys.exit(code)
