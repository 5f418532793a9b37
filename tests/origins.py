"""Who wrote each piece of a process's output (tests/test_stray_lines.py).

``install()``, run first thing in a subprocess, puts a recorder in front of ``sys.stdout`` and
``sys.stderr``: every write goes through to the real stream at once (so the bytes on the file
descriptors keep their order) and is recorded with its origin; at exit the records go to the JSON
file named by ``$LINEARIZE_ORIGINS`` as ``[stream, origin, text]`` lists. Anything on the descriptors
that no record accounts for was written by something else: a subprocess, or C code.

An origin is the module whose code wrote, seen through the machinery of printing:

- ``warning``: ``warnings.showwarning`` (any warning shown);
- ``logging:<logger name>``: a logging handler;
- ``tqdm:<module>``: a progress bar (or ``tqdm.write``), by the module that created the bar;
  ``tqdm-transient:<module>`` for a bar created with ``leave=False`` (cleared when it closes);
- otherwise the module that called ``print`` or ``write``.

Nothing here imports more than tqdm, so the process under test loads what it would load anyway.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

RECORDS: list[list[str]] = []


def _module(frame) -> str:
    return frame.f_globals.get("__name__") or "?"


def _is_tqdm(name: str) -> bool:
    return name == "tqdm" or name.startswith("tqdm.")


def origin(frame) -> str:
    """The origin of a write whose caller is ``frame`` (see the module docstring)."""
    through_tqdm = False
    while frame is not None:
        name = _module(frame)
        if name == "warnings":
            return "warning"
        if name == "logging":
            record = frame.f_locals.get("record")
            return f"logging:{getattr(record, 'name', '?')}"
        if _is_tqdm(name):
            site = getattr(frame.f_locals.get("self"), "_origin_site", None)
            if site is not None:
                return site
            through_tqdm = True
        elif name != __name__:
            return f"tqdm:{name}" if through_tqdm else name
        frame = frame.f_back
    return "tqdm:?" if through_tqdm else "?"


class Recorder:
    """A text stream in front of ``stream`` that records each write with its origin."""

    def __init__(self, stream, name: str):
        self._stream, self._name = stream, name

    def write(self, text):
        if text:
            RECORDS.append([self._name, origin(sys._getframe(1)), str(text)])
        written = self._stream.write(text)
        self._stream.flush()
        return written

    def flush(self):
        self._stream.flush()

    def __getattr__(self, attr):
        return getattr(self._stream, attr)


def _dump(path: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    with open(path, "w", encoding="utf-8") as f:
        json.dump(RECORDS, f)


def install() -> None:
    import tqdm.std

    init = tqdm.std.tqdm.__init__

    def __init__(self, *args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None and (_is_tqdm(_module(frame)) or _module(frame) == __name__):
            frame = frame.f_back
        kind = "tqdm" if kwargs.get("leave", True) else "tqdm-transient"
        self._origin_site = f"{kind}:{_module(frame) if frame is not None else '?'}"
        init(self, *args, **kwargs)

    tqdm.std.tqdm.__init__ = __init__
    sys.stdout = Recorder(sys.stdout, "stdout")
    sys.stderr = Recorder(sys.stderr, "stderr")
    atexit.register(_dump, os.environ["LINEARIZE_ORIGINS"])
