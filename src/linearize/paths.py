"""Where linearize keeps what it fetches or derives (dequantised teachers, corpora)."""

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$LINEARIZE_HOME`` (default ``~/.cache/linearize``) joined with ``parts``, created on demand."""
    root = Path(os.environ.get("LINEARIZE_HOME", Path.home() / ".cache" / "linearize"))
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
