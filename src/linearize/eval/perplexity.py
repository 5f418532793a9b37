"""Perplexity: exp of the mean next-token loss over packed blocks."""

from __future__ import annotations

import math

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
