"""Reading a text source into documents: a file, a folder, a JSONL file, a Hugging Face dataset,
or the embedded Gutenberg corpus."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import LinearizeError
from . import corpora, named
from .gutenberg import GUTENBERG_BOOKS, gutenberg_paths, is_gutenberg
from .mixture import parse_mixture
from .suffixes import READABLE_SUFFIXES

ACCEPTED_SOURCES = "give a .txt/.md/.jsonl file, a folder of them, hf:NAME[:CONFIG][@SPLIT], or 'gutenberg'"
SOURCE_HELP = ("a .txt/.md/.jsonl file, a folder of them, hf:NAME[:CONFIG][@SPLIT], 'gutenberg' (the default), "
               "generated:NAME (text made by 'linearize data generate'), corpus:NAME (an extra corpus, fetched on "
               f"first use: {', '.join(corpora.CORPORA)}), or a mixture of these: A,B (every block of each once) or "
               "A=W,B=W (weights: shares of the training blocks, e.g. gutenberg=0.5,notes.txt=0.5)")

# Control characters that text does not contain (tab, line and page breaks aside): C0, DEL and C1.
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")
CONTROL_SHARE_MAX = 0.05  # above this share of control characters a file is taken for binary data


def read_texts(source: str | Path | None = None, text_field: str = "text") -> list[str]:
    """Read ``source`` into a list of non-blank documents.

    ``source`` is one of:

    * ``None`` or ``"gutenberg"``: the 18 embedded Gutenberg books (see ``gutenberg_dir``);
    * a ``.txt``/``.md`` file: one document;
    * a ``.jsonl`` file: one document per line, taken from each object's ``text_field``;
    * a folder: every ``.txt``/``.md``/``.jsonl`` file below it, sorted by path;
    * ``"hf:NAME[:CONFIG][@SPLIT]"``: a Hugging Face dataset (needs ``datasets`` and the hub).

    * ``"generated:NAME"``: text sampled from a teacher by ``linearize data generate``;
    * ``"corpus:NAME"``: an extra corpus fetched on first use (``data.corpora.CORPORA``).

    Blank documents are dropped; a source with no text at all raises ``LinearizeError``.
    """
    source = resolve_source(source)
    if is_gutenberg(source):
        return [read_text_file(path) for path in gutenberg_paths(GUTENBERG_BOOKS)]
    if isinstance(source, str) and source.startswith("hf:"):
        texts = read_hf(source, text_field)
    else:
        texts = [text for path in source_files(source) for text in read_file(path, text_field)]
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise LinearizeError(f"no text in {source}: every document is empty or blank ({ACCEPTED_SOURCES})")
    return texts


def check_source(source: str | Path | None) -> None:
    """Fail at once, with one line, on a source that cannot be read: a missing path, an unsupported
    file type, a malformed ``hf:`` name (cheap checks, before any tokenizer or model loads)."""
    parts = parse_mixture(source)
    if parts is not None:
        for part in parts:
            check_source(part.source)
        return
    if is_gutenberg(source):
        return
    if isinstance(source, str) and source.startswith("hf:"):
        parse_hf(source)
    elif named.is_named(source):
        named.check_named(source)
    else:
        source_files(source)


def resolve_source(source):
    """The folder a named source stands for (``generated:NAME``, ``corpus:NAME``, fetched on first
    use); any other source as it is."""
    return named.resolve(source) if named.is_named(source) else source


def source_files(source: str | Path) -> list[Path]:
    """The files a path source stands for: the file itself, or the text files below a folder."""
    path = Path(source).expanduser()
    if not path.exists():
        raise LinearizeError(f"no such file or folder: {source} ({ACCEPTED_SOURCES})")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in READABLE_SUFFIXES)
        if not files:
            raise LinearizeError(f"no .txt, .md or .jsonl files in folder {source} ({ACCEPTED_SOURCES})")
        return files
    if path.suffix.lower() not in READABLE_SUFFIXES:
        raise LinearizeError(f"cannot read {source}: unsupported file type '{path.suffix}' ({ACCEPTED_SOURCES})")
    return [path]


def read_file(path: Path, text_field: str) -> list[str]:
    if path.suffix.lower() == ".jsonl":
        return read_jsonl(path, text_field)
    return [read_text_file(path)]


def read_text_file(path: Path) -> str:
    """Decode a text file as UTF-8, falling back to Latin-1 (some Gutenberg books are Latin-1).

    A file that is not text (NUL bytes, or more than ``CONTROL_SHARE_MAX`` control characters:
    binary data, UTF-16) raises ``LinearizeError`` naming it, rather than becoming training blocks.
    """
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    check_is_text(text, path)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def check_is_text(text: str, path) -> None:
    """Raise ``LinearizeError`` unless ``text`` (the decoded content of ``path``) looks like text."""
    if "\x00" in text:
        why = "it contains NUL bytes"
    else:
        share = len(_CONTROL.findall(text)) / max(1, len(text))
        if share <= CONTROL_SHARE_MAX:
            return
        why = f"{share:.0%} of its characters are control characters"
    raise LinearizeError(f"{path} is not a text file ({why}); give UTF-8 or Latin-1 text ({ACCEPTED_SOURCES})")


def read_jsonl(path: Path, text_field: str) -> list[str]:
    """One document per non-blank line; each line must be a JSON object with a string ``text_field``."""
    texts = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise LinearizeError(
                    f"{path}:{number}: not valid JSON ({error.msg}); "
                    f"each line must be an object with a '{text_field}' field"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                raise LinearizeError(
                    f"{path}:{number}: no '{text_field}' field; "
                    f"each line must be an object with a '{text_field}' string"
                )
            if not isinstance(record[text_field], str):
                raise LinearizeError(
                    f"{path}:{number}: '{text_field}' is {type(record[text_field]).__name__}, expected a string"
                )
            texts.append(record[text_field])
    return texts


def parse_hf(source: str) -> tuple[str, str | None, str]:
    """Split ``hf:NAME[:CONFIG][@SPLIT]`` into (name, config, split); split defaults to ``train``."""
    spec, at, split = source.removeprefix("hf:").partition("@")
    name, colon, config = spec.partition(":")
    if not name or (colon and not config) or (at and not split):
        raise LinearizeError(
            f"bad Hugging Face dataset '{source}': expected hf:NAME[:CONFIG][@SPLIT], "
            "e.g. hf:wikitext:wikitext-2-raw-v1@train"
        )
    return name, config or None, split or "train"


def read_hf(source: str, text_field: str) -> list[str]:
    """Load a Hugging Face dataset split and take its ``text_field`` column."""
    name, config, split = parse_hf(source)
    try:
        import datasets  # optional dependency, only needed for hf: sources
    except ImportError:
        raise LinearizeError(
            f"{source} needs the 'datasets' package: pip install datasets (or give a local .txt/.jsonl file)"
        ) from None
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # the hub, auth and format errors have no common base class
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LinearizeError(f"could not load Hugging Face dataset {source}: {reason}") from None
    if text_field not in dataset.column_names:
        columns = ", ".join(dataset.column_names)
        raise LinearizeError(f"Hugging Face dataset {source} has no '{text_field}' column (columns: {columns})")
    return [text for text in dataset[text_field] if isinstance(text, str)]
