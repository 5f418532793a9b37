"""Deterministic train / validation splits: the Gutenberg books by name, other sources by a seeded
hash of each document's content, a single document by its last blocks."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import LinearizeError
from . import packing
from .gutenberg import GUTENBERG_TRAIN, GUTENBERG_VALIDATION, gutenberg_paths, is_gutenberg
from .sources import read_text_file, read_texts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SPLITS = ("train", "validation")


def build_splits(
    source: str | Path | None,
    tokenizer: PreTrainedTokenizerBase,
    block_len: int,
    val_fraction: float,
    seed: int,
    text_field: str,
) -> dict[str, torch.Tensor]:
    """Read, split and pack ``source`` into ``{"train": ..., "validation": ...}``."""
    name = "the Gutenberg corpus" if is_gutenberg(source) else str(source)
    if is_gutenberg(source):
        documents = {
            "train": [read_text_file(path) for path in gutenberg_paths(GUTENBERG_TRAIN)],
            "validation": [read_text_file(path) for path in gutenberg_paths(GUTENBERG_VALIDATION)],
        }
    else:
        texts = read_texts(source, text_field)
        if len(texts) == 1:
            return split_single_document(texts[0], tokenizer, block_len, val_fraction, name)
        documents = split_documents(texts, val_fraction, seed)
    return {
        split: packing.cut_blocks(
            packing.token_stream(texts, tokenizer), block_len, f"the {split} split of {name}", packing.leading_bos(tokenizer)
        )
        for split, texts in documents.items()
    }


def split_documents(texts: Sequence[str], val_fraction: float, seed: int) -> dict[str, list[str]]:
    """Assign each document to train or validation by a seeded hash of its content.

    Hashing content rather than position keeps a document's side stable when others are added,
    removed or reordered, and sends duplicates to the same side.
    """
    scores = [document_score(text, seed) for text in texts]
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


def document_score(text: str, seed: int) -> float:
    """A number in [0, 1) that depends only on ``seed`` and the document's content."""
    digest = hashlib.sha256(f"{seed}\0".encode() + text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_single_document(
    text: str, tokenizer: PreTrainedTokenizerBase, block_len: int, val_fraction: float, name: str
) -> dict[str, torch.Tensor]:
    """Split one document's blocks: the last ``val_fraction`` (at least one) are validation."""
    blocks = packing.cut_blocks(packing.token_stream([text], tokenizer), block_len, name, packing.leading_bos(tokenizer))
    n_blocks = blocks.shape[0]
    if n_blocks < 2:
        raise LinearizeError(
            f"{name} is one document of only {n_blocks} block of block_len={block_len} tokens, too little "
            "to split into train and validation; give more text or a smaller block_len"
        )
    n_validation = max(1, int(n_blocks * val_fraction))
    return {"train": blocks[:-n_validation].clone(), "validation": blocks[-n_validation:].clone()}


def limit(blocks: torch.Tensor, max_blocks: int | None, split: str, seed: int) -> torch.Tensor:
    """At most ``max_blocks`` rows: the first ones of validation (evaluation stays comparable), a
    seeded random choice of training rows kept in stream order."""
    if max_blocks is None or max_blocks >= blocks.shape[0]:
        return blocks
    if split == "validation":
        return blocks[:max_blocks].clone()
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(blocks.shape[0], generator=generator)[:max_blocks].sort().values
    return blocks[chosen]
