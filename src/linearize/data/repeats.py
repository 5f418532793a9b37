"""``with_repeats``: training blocks in which a span of earlier text comes again, verbatim, later.

Natural text rarely repeats a passage word for word, so a student trained on it to imitate the
teacher's attention seldom sees the teacher copy from far back: its induction heads (the query of the
token after a repeated prefix attends to what followed that prefix before) fire on names and commands
a few times a block, on long verbatim repeats almost never. Code and documentation repeat identifiers,
lines and commands all the time, and chat repeats what the user wrote. ``with_repeats`` rewrites a
seeded share of the training blocks so that each holds one such repeat: a span of ``SPAN`` tokens
(drawn per block) copied over the text at least ``MIN_GAP`` tokens after it, past any sliding window,
where only a memory of older tokens can supply it. Validation blocks are never rewritten.
"""

from __future__ import annotations

import torch

from ..errors import LinearizeError

SPAN = (16, 128)  # a repeated span's length, drawn uniformly per block (inclusive)
MIN_GAP = 128  # tokens between the span's end and its repeat, at least


def with_repeats(blocks: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """A copy of ``blocks`` ``[N, L]`` in which ``round(fraction * N)`` rows (a seeded choice) each repeat one
    span of their own text: tokens ``[a, a + P)`` written again at ``[b, b + P)``, ``b >= a + P + MIN_GAP``,
    ``P`` in ``SPAN`` (shortened to fit short blocks). ``fraction`` 0 returns ``blocks`` itself."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise LinearizeError(f"repeats must be a share of the training blocks in [0, 1], got {fraction!r}")
    n, length = blocks.shape
    count = round(fraction * n)
    if count == 0:
        return blocks
    longest = min(SPAN[1], (length - MIN_GAP) // 2)
    if longest < 1:
        raise LinearizeError(f"repeats need blocks longer than {MIN_GAP + 1} tokens, got {length}")
    shortest = min(SPAN[0], longest)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n, generator=gen)[:count].sort().values
    out = blocks.clone()
    for row in rows.tolist():
        span = int(torch.randint(shortest, longest + 1, (), generator=gen))
        a = int(torch.randint(0, length - 2 * span - MIN_GAP + 1, (), generator=gen))
        b = int(torch.randint(a + span + MIN_GAP, length - span + 1, (), generator=gen))
        out[row, b : b + span] = out[row, a : a + span]
    return out
