"""Packed blocks cached on disk under ``cache_dir("blocks")``, keyed by what they depend on: the
source's files (paths, sizes, mtimes) or name, the tokenizer, ``block_len``, ``val_fraction`` and ``seed``."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..paths import cache_dir
from .gutenberg import GUTENBERG_PACKAGE, is_gutenberg
from .packing import leading_bos
from .sources import source_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Bump when the cache layout or packing rules change, so stale caches are never reused.
CACHE_VERSION = "1"


def source_identity(source: str | Path | None, text_field: str) -> list:
    """What the packed blocks depend on in ``source``: its files' paths, sizes and mtimes, or its name."""
    if is_gutenberg(source):
        return ["gutenberg", GUTENBERG_PACKAGE]
    if isinstance(source, str) and source.startswith("hf:"):
        return ["hf", source, text_field]
    files = []
    for path in source_files(source):
        stat = path.stat()
        files.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return ["files", files, text_field]


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> list:
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


def cache_key(
    source: str | Path | None,
    tokenizer: PreTrainedTokenizerBase,
    block_len: int,
    val_fraction: float,
    seed: int,
    text_field: str,
) -> str:
    parts = {
        "version": CACHE_VERSION,
        "source": source_identity(source, text_field),
        "tokenizer": tokenizer_identity(tokenizer),
        "block_len": block_len,
        "val_fraction": float(val_fraction),
        "seed": seed,
    }
    bos = leading_bos(tokenizer)
    if bos is not None:  # rows start with BOS; tokenizers without one keep their earlier keys
        parts["bos"] = bos
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cache_path(key: str, split: str) -> Path:
    return cache_dir("blocks") / f"{key}-{split}.pt"


def load_cached(path: Path) -> torch.Tensor | None:
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


def save_cached(path: Path, blocks: torch.Tensor) -> None:
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
