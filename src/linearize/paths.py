"""Where linearize keeps what it fetches or derives (dequantised teachers, corpora), how processes
take turns publishing there, and how it reads back the JSON-lines files it writes (metrics, generated text)."""

import contextlib
import json
import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$LINEARIZE_HOME`` (default ``~/.cache/linearize``) joined with ``parts``, created on demand."""
    root = Path(os.environ.get("LINEARIZE_HOME", Path.home() / ".cache" / "linearize"))
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def publish_lock(target: Path):
    """An exclusive lock on ``.<name>.lock`` beside ``target`` while a finished copy is moved into place
    (``fcntl``, POSIX; elsewhere none): a process that checks ``target`` and then replaces it cannot
    interleave with another doing the same (two test workers fetching one corpus or dequantising one
    teacher on a cold cache)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(Path(target).with_name(f".{Path(target).name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_json_lines(path) -> list:
    """The records of a JSON-lines file, one per non-blank line. Lines end at "\\n" alone: JSON leaves
    U+2028, U+2029 and U+0085 raw inside strings, and ``str.splitlines()`` would cut a record there."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line.strip()]
