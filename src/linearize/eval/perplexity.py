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
# the --by-position buckets: [0, 256), [256, 1k), [1k, 4k), [4k, 8k), [8k, 16k), [16k, 32k), those that fit the block
POSITION_EDGES = (0, 256, 1024, 4096, 8192, 16384, 32768)
POSITION_LEN = 8192  # the by-position block length unless asked (--position-len): the first four buckets


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
    49k vocabulary is off by up to 2e-4 nats per token on the CPU), so that at most ``LOGIT_BUDGET``
    logits exist at once (a large vocabulary at batch 32 would need tens of GB): the forward split
    over rows; where one row alone is over the budget (a 49k vocabulary from 5,462 tokens on: a
    32k-token block would hold 1.6G logits), the model runs to its last hidden states and the
    output layer and the loss go over slices of time (:func:`output_head`; the same logits)."""
    vocab = model.config.get_text_config().vocab_size
    if batch.shape[1] * vocab > LOGIT_BUDGET:
        head = output_head(model, batch[:1, :8])
        if head is not None:
            return _sliced_nll(*head, batch, vocab)
    rows = max(1, LOGIT_BUDGET // max(1, batch.shape[1] * vocab))
    out = []
    for j in range(0, len(batch), rows):
        part = batch[j : j + rows]
        logits = model(part, use_cache=False).logits
        out.append(_nll(logits[:, :-1], part[:, 1:]))
        del logits
    return torch.cat(out)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float64 next-token losses of ``logits`` ``[B, T, V]`` against ``targets`` ``[B, T]``, the
    softmax taken along the last (contiguous) dimension. ``cross_entropy`` of ``[B, V, T]`` (the vocabulary
    moved to dimension 1) gives the same values by a strided softmax: 3.3x slower on a CPU at Gemma's
    262k vocabulary ([1, 256, 262144]), and on CUDA a different kernel (the spatial softmax)."""
    flat = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1),
                                             reduction="none")
    return flat.view(targets.shape)


def _sliced_nll(trunk, head, batch: torch.Tensor, vocab: int) -> torch.Tensor:
    """:func:`token_nll` from ``trunk``'s last hidden states, ``head`` applied ``LOGIT_BUDGET`` logits
    at a time along time (a row at a time)."""
    out = torch.empty(batch.shape[0], batch.shape[1] - 1, dtype=torch.float64, device=batch.device)
    step = max(1, LOGIT_BUDGET // vocab)
    for j in range(len(batch)):
        part = batch[j : j + 1]
        hidden = trunk(part, use_cache=False).last_hidden_state  # [1, T, H]: small beside the logits
        for s in range(0, part.shape[1] - 1, step):
            e = min(s + step, part.shape[1] - 1)
            logits = head(hidden[:, s:e])
            out[j : j + 1, s:e] = _nll(logits, part[:, s + 1 : e + 1])
            del logits
        del hidden
    return out


def output_head(model, probe: torch.Tensor):
    """``(trunk, head)`` with ``model(ids).logits == head(trunk(ids).last_hidden_state)``: the base model
    and the output embedding (with Gemma's final soft-cap), or None where the model is not built so.
    Checked on ``probe`` (a few tokens): ``head`` of the hidden states the model's own forward
    passes on must give its logits, so a family that scales or caps its logits otherwise falls back
    to the whole forward instead of scoring something else."""
    trunk = getattr(model, "base_model", None)
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if trunk is None or trunk is model or lm_head is None:
        return None
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)

    def head(hidden):
        logits = lm_head(hidden)
        return logits if not cap else torch.tanh(logits / cap) * cap

    seen = []
    hook = trunk.register_forward_hook(lambda module, args, out: seen.append(
        out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]))
    try:
        logits = model(probe, use_cache=False).logits
    finally:
        hook.remove()
    if len(seen) != 1 or not torch.equal(head(seen[0]), logits):
        return None
    return trunk, head


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
                    batch_size: int = 4, progress: bool = True, split: str | None = None,
                    blocks: torch.Tensor | None = None) -> dict:
    """Perplexity on a text ``source`` (None: the held-out Gutenberg books).

    The text is packed into ``block_len`` blocks (the first ``max_blocks`` of them when given):
    the whole of a user's ``source``, or its ``split`` when asked (see :func:`source_blocks`);
    ``blocks``: those blocks already packed (a caller scoring several models on them).
    Returns the value with what it was measured on.
    """
    split = split or default_split(source)
    if blocks is None:
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


def is_student(model) -> bool:
    """Whether ``model`` is a linearize student (a converted model: ``config.linearize``), whose linear
    state runs any length, unbound by its teacher's ``max_position_embeddings``."""
    return bool(getattr(model.config, "linearize", None))


def position_block_len(model, position_len: int | None = None) -> tuple[int, int, int | None]:
    """``(block_len, asked, context)`` of a by-position pass: ``asked`` is ``position_len`` or
    ``POSITION_LEN``; a softmax model's blocks stop at its context (``max_position_embeddings``), as do
    every model's by default (so a student's default row compares with its teacher's); a student
    asked for a length gets it (its linear state runs any length)."""
    context = getattr(model.config, "max_position_embeddings", None)
    context = int(context) if context else None
    asked = POSITION_LEN if position_len is None else int(position_len)
    if isinstance(position_len, bool) or asked < 2:
        raise LinearizeError(f"the by-position block length must be at least 2 tokens, got {position_len!r}")
    capped = context is not None and asked > context and (position_len is None or not is_student(model))
    return (context if capped else asked), asked, context


def position_edges(block_len: int, edges=POSITION_EDGES) -> list[int]:
    """The bucket edges of a ``block_len``-token block: ``edges`` below it, then ``block_len`` (the
    last bucket ends at the block; one past ``edges`` runs from their last to the block's end)."""
    return [e for e in edges if e < block_len] + [block_len]


def perplexity_by_position(model, tokenizer, source=None, block_len: int | None = None,
                           max_blocks: int | None = None, batch_size: int = 1, progress: bool = True,
                           split: str | None = None, edges=POSITION_EDGES) -> dict:
    """Loss and perplexity in position buckets (0-256, 256-1k, 1k-4k, 4k-8k, 8k-16k, 16k-32k: those
    inside the block) over blocks of ``block_len`` tokens (default ``POSITION_LEN``, 8,192), so a rise
    in the late buckets shows a state that forgets.

    The split's documents are joined (EOS between them) and cut into blocks, so short documents
    make long blocks; a split shorter than one block is one LinearizeError saying how many tokens
    it has. A softmax model's blocks stop at its context (``max_position_embeddings``; the buckets
    past it are listed in ``left_out`` with a ``note``); a linearize student's do not (its linear
    state runs any length; only its default length is the context's, to compare with the teacher).
    """
    block_len, asked, context = position_block_len(model, block_len)
    wanted, edges = position_edges(asked, edges), position_edges(block_len, edges)
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
    record = {
        "source": "gutenberg" if source is None else str(source),
        "split": split or default_split(source),
        "block_len": block_len,
        "position_len": asked,
        "context": context,
        "student": is_student(model),
        "blocks": int(blocks.shape[0]),
        "buckets": buckets,
        "seconds": round(time.perf_counter() - start, 1),
    }
    if block_len < asked:  # a softmax model's context (or a default row's) cut the blocks short
        record["left_out"] = [f"{_short(lo)}-{_short(hi)}" for lo, hi in zip(wanted, wanted[1:]) if hi > block_len]
        who = "a student's default length" if is_student(model) else "a softmax model"
        record["note"] = (f"{who}: blocks capped at the model's {context}-token context (asked {asked}); "
                          f"buckets {', '.join(record['left_out'])} left out")
    return record


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
