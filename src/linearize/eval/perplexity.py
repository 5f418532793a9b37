"""Perplexity: exp of the mean next-token loss over packed blocks, overall and by position in a block.

Which text is scored: the default corpus's held-out books (its validation split), or the whole of a
user's ``source`` unless a ``split`` is asked for (``train`` / ``validation``: the deterministic
split of ``linearize.data.load_blocks``).
"""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from linearize.errors import LinearizeError

SPLITS = ("all", "train", "validation")
POSITION_EDGES = (0, 256, 1024, 4096, 8192)  # the --by-position buckets: [0, 256), [256, 1k), [1k, 4k), [4k, 8k)


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 4, progress: bool = True) -> float:
    """exp(mean token NLL) of ``model`` over ``blocks`` [N, T] (every token after the first of a block)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in tqdm(range(0, len(blocks), batch_size), desc="perplexity", disable=not progress, leave=False):
        batch = blocks[i : i + batch_size].to(device)
        total += token_nll(model, batch).double().sum().item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


LOGIT_BUDGET = 2**28  # logits held at once (in float64: 2 GiB); a 262k-entry vocabulary fits 1 row of 1,024


def token_nll(model, batch: torch.Tensor) -> torch.Tensor:
    """``[B, T - 1]`` next-token losses of ``batch`` ``[B, T]`` in float64 (an fp32 log-sum-exp over a
    49k vocabulary is off by up to 2e-4 nats per token on the CPU), the forward split over rows so
    that at most ``LOGIT_BUDGET`` logits exist at once (a large vocabulary at batch 32 would need tens
    of GB)."""
    rows = max(1, LOGIT_BUDGET // max(1, batch.shape[1] * model.config.get_text_config().vocab_size))
    out = []
    for j in range(0, len(batch), rows):
        part = batch[j : j + rows]
        logits = model(part, use_cache=False).logits
        out.append(torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).double(), part[:, 1:],
                                                     reduction="none"))
        del logits
    return torch.cat(out)


def default_split(source) -> str:
    """``validation`` for the default corpus (its held-out books), ``all`` for a user's text."""
    return "validation" if source in (None, "gutenberg") else "all"


def source_blocks(source, tokenizer, block_len: int, split: str | None = None,
                  max_blocks: int | None = None) -> torch.Tensor:
    """``[n, block_len]`` blocks of ``source``'s ``split`` (None: :func:`default_split`); ``all`` is the
    whole text packed (documents joined by EOS), the first ``max_blocks`` when given."""
    from linearize.data import load_blocks, pack_blocks, read_texts

    split = split or default_split(source)
    if split not in SPLITS:
        raise LinearizeError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if split == "all":
        if source in (None, "gutenberg"):
            raise LinearizeError("split 'all' of the default corpus would score its training books; use "
                                 "'validation' (its held-out books) or give --source")
        blocks = pack_blocks(read_texts(source), tokenizer, block_len)
        return blocks if max_blocks is None else blocks[:max_blocks]
    return load_blocks(source, tokenizer, block_len, split=split, max_blocks=max_blocks)


def text_perplexity(model, tokenizer, source=None, block_len: int = 1024, max_blocks: int | None = None,
                    batch_size: int = 4, progress: bool = True, split: str | None = None) -> dict:
    """Perplexity on a text ``source`` (None: the held-out Gutenberg books).

    The text is packed into ``block_len`` blocks (the first ``max_blocks`` of them when given):
    the whole of a user's ``source``, or its ``split`` when asked (see :func:`source_blocks`).
    Returns the value with what it was measured on.
    """
    split = split or default_split(source)
    blocks = source_blocks(source, tokenizer, block_len, split, max_blocks)
    start = time.perf_counter()
    value = perplexity(model, blocks, batch_size=batch_size, progress=progress)
    return {
        "value": value,
        "source": "gutenberg" if source is None else str(source),
        "split": split,
        "block_len": block_len,
        "blocks": int(blocks.shape[0]),
        "tokens_scored": int(blocks.shape[0] * (blocks.shape[1] - 1)),
        "max_blocks": max_blocks,
        "seconds": round(time.perf_counter() - start, 1),
    }


@torch.no_grad()
def position_losses(model, blocks: torch.Tensor, edges=POSITION_EDGES, batch_size: int = 1,
                    progress: bool = True) -> list[tuple[float, int]]:
    """``(summed NLL, tokens)`` per position bucket ``[edges[i], edges[i + 1])``: the loss of the token
    at position ``p`` of a block (predicted from the ``p`` before it), for ``p >= 1``."""
    device = next(model.parameters()).device
    sums = [0.0] * (len(edges) - 1)
    counts = [0] * (len(edges) - 1)
    for i in tqdm(range(0, len(blocks), batch_size), desc="loss by position", disable=not progress, leave=False):
        batch = blocks[i : i + batch_size].to(device)
        nll = token_nll(model, batch)  # [B, T - 1]: token p = column p - 1
        for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
            part = nll[:, max(lo, 1) - 1 : hi - 1]
            sums[b] += part.double().sum().item()
            counts[b] += part.numel()
    return list(zip(sums, counts))


def perplexity_by_position(model, tokenizer, source=None, block_len: int | None = None,
                           max_blocks: int | None = None, batch_size: int = 1, progress: bool = True,
                           split: str | None = None, edges=POSITION_EDGES) -> dict:
    """Loss and perplexity in position buckets (default 0-256, 256-1k, 1k-4k, 4k-8k) over blocks of
    ``block_len`` tokens (default: the last edge, capped at the model's context), so a rise in the
    late buckets shows a state that forgets. Buckets beyond the block are left out."""
    context = getattr(model.config, "max_position_embeddings", None)
    block_len = block_len or (min(edges[-1], context) if context else edges[-1])
    edges = [e for e in edges if e < block_len] + [block_len]
    try:
        blocks = source_blocks(source, tokenizer, block_len, split, max_blocks)
    except LinearizeError as err:
        raise LinearizeError(f"perplexity by position needs {block_len}-token blocks: {err}") from None
    start = time.perf_counter()
    rows = position_losses(model, blocks, edges, batch_size=batch_size, progress=progress)
    buckets = []
    for (lo, hi), (total, count) in zip(zip(edges, edges[1:]), rows):
        loss = total / count if count else None
        buckets.append({"range": f"{_short(lo)}-{_short(hi)}", "start": lo, "end": hi, "tokens": count,
                        "loss": loss, "perplexity": math.exp(loss) if loss is not None else None})
    return {
        "source": "gutenberg" if source is None else str(source),
        "split": split or default_split(source),
        "block_len": block_len,
        "blocks": int(blocks.shape[0]),
        "buckets": buckets,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
