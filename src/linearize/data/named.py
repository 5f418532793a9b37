"""Sources named rather than given as paths: ``generated:NAME`` (text made by ``linearize data
generate`` under ``cache_dir("generated")``) and ``corpus:NAME`` (an extra corpus, ``data.corpora``),
each standing for a folder of documents."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import LinearizeError
from ..paths import cache_dir
from . import corpora

GENERATED = "generated:"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def generated_dir(name: str) -> Path:
    """The folder of ``generated:NAME`` (not created)."""
    if not _NAME.match(name):
        raise LinearizeError(f"bad name for generated text {name!r}: use letters, digits, '.', '_' and '-'")
    return cache_dir("generated") / name


def is_named(source) -> bool:
    return isinstance(source, str) and source.startswith((GENERATED, corpora.PREFIX))


def check_named(source: str) -> None:
    """One line, at once, for a name that stands for nothing (a corpus is fetched only when read)."""
    if source.startswith(corpora.PREFIX):
        corpora.corpus(source)
    else:
        resolve(source)


def resolve(source: str) -> Path:
    """The folder ``source`` stands for, a corpus fetched on first use."""
    if source.startswith(corpora.PREFIX):
        return corpora.corpus_dir(source)
    name = source.removeprefix(GENERATED)
    folder = generated_dir(name)
    if not any(folder.glob("part-*.jsonl")):
        raise LinearizeError(f"no generated text named {name!r} (in {folder}); make it with "
                             f"`linearize data generate --name {name} --tokens N`")
    return folder
