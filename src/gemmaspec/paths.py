"""Where gemmaspec keeps what it builds once: ``$GEMMASPEC_HOME`` or ``~/.cache/gemmaspec``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """The cache directory (created if missing)."""
    root = os.environ.get("GEMMASPEC_HOME")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "gemmaspec"
    path.mkdir(parents=True, exist_ok=True)
    return path
