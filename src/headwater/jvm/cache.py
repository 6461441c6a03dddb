"""Where headwater keeps what it fetches or builds once per machine, outside the repository:
``$HEADWATER_CACHE``, else ``$XDG_CACHE_HOME/headwater``, else ``~/.cache/headwater``."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HEADWATER_CACHE"


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "headwater"
