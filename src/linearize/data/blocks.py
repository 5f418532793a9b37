"""``load_blocks``: one split of a source as packed token blocks, built once and cached."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import LinearizeError
from . import block_cache as cache
from .mixture import mix, parse_mixture
from .packing import check_block_len
from .sources import resolve_source
from .splits import SPLITS, build_splits, limit

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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

    ``source`` may be a mixture, ``a,b`` or ``a=W,b=W`` (``data.mixture``): each source is loaded
    as above and the split assembled from them.
    """
    if tokenizer is None:
        raise TypeError("load_blocks() needs a tokenizer")
    check_block_len(block_len)
    if split not in SPLITS:
        raise LinearizeError(f"unknown split {split!r}: expected 'train' or 'validation'")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise LinearizeError(f"val_fraction must be a number between 0 and 1 (exclusive), got {val_fraction!r}")
    if max_blocks is not None and (isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1):
        raise LinearizeError(f"max_blocks must be a positive integer or None, got {max_blocks!r}")

    parts = parse_mixture(source)
    if parts is not None:
        blocks = [load_blocks(p.source, tokenizer, block_len, split, val_fraction, seed, None, text_field) for p in parts]
        return limit(mix(parts, blocks, split, seed), max_blocks, split, seed)
    source = resolve_source(source)
    key = cache.cache_key(source, tokenizer, block_len, val_fraction, seed, text_field)
    blocks = cache.load_cached(cache.cache_path(key, split))
    if blocks is None:
        built = build_splits(source, tokenizer, block_len, val_fraction, seed, text_field)
        for name, tensor in built.items():
            cache.save_cached(cache.cache_path(key, name), tensor)
        blocks = built[split]
    return limit(blocks, max_blocks, split, seed)

