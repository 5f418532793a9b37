"""Where linearize keeps what it fetches or derives (dequantised teachers, corpora), and how it reads
back the JSON-lines files it writes (metrics, generated text)."""

import json
import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$LINEARIZE_HOME`` (default ``~/.cache/linearize``) joined with ``parts``, created on demand."""
    root = Path(os.environ.get("LINEARIZE_HOME", Path.home() / ".cache" / "linearize"))
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_json_lines(path) -> list:
    """The records of a JSON-lines file, one per non-blank line. Lines end at "\\n" alone: JSON leaves
    U+2028, U+2029 and U+0085 raw inside strings, and ``str.splitlines()`` would cut a record there."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line.strip()]
