"""Perplexity: exp of the mean next-token loss over packed blocks."""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 4, progress: bool = True) -> float:
    """exp(mean token NLL) of ``model`` over ``blocks`` [N, T] (every token after the first of a block)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in tqdm(range(0, len(blocks), batch_size), desc="perplexity", disable=not progress, leave=False):
        batch = blocks[i : i + batch_size].to(device)
        logits = model(batch, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        total += nll.item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def text_perplexity(model, tokenizer, source=None, block_len: int = 1024, max_blocks: int | None = None,
                    batch_size: int = 4, progress: bool = True) -> dict:
    """Perplexity on the validation split of a text ``source`` (None: the held-out Gutenberg books).

    The text is packed into ``block_len`` blocks by ``linearize.data.load_blocks`` (the first
    ``max_blocks`` of them when given); returns the value with what it was measured on.
    """
    from linearize.data import load_blocks

    blocks = load_blocks(source, tokenizer, block_len, split="validation", max_blocks=max_blocks)
    start = time.perf_counter()
    value = perplexity(model, blocks, batch_size=batch_size, progress=progress)
    return {
        "value": value,
        "source": "gutenberg" if source is None else str(source),
        "split": "validation",
        "block_len": block_len,
        "blocks": int(blocks.shape[0]),
        "tokens_scored": int(blocks.shape[0] * (blocks.shape[1] - 1)),
        "max_blocks": max_blocks,
        "seconds": round(time.perf_counter() - start, 1),
    }
