"""Mixtures of sources: ``a,b,c`` or ``a=W,b=W,...`` wherever a source is taken (``--data``,
``load_blocks``), so every recipe trains on a mixture with no change of its own.

* ``a,b``: every block of each source once (each source in its natural share).
* ``a=3,b=1``: weights are shares of the training blocks. The mixture holds as many training
  blocks as its sources together; a source gets ``weight / sum(weights)`` of them: a seeded
  random choice of its blocks where that is fewer than it has, its blocks repeated (whole copies,
  then a seeded choice) where more.

Validation holds every validation block of each source once, never repeated, interleaved so that
its first N blocks (``max_blocks``) follow the weights (or the natural shares) as far as the
sources have blocks. Training blocks are interleaved the same way: a short run meets every source.
Each source is packed and cached on its own (``load_blocks``); the mixture is assembled from
those caches on every call, which costs only indexing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LinearizeError

if TYPE_CHECKING:
    import torch

SYNTAX = "SOURCE,SOURCE,... or SOURCE=WEIGHT,SOURCE=WEIGHT,... (e.g. gutenberg=0.5,generated:smol=0.5)"


@dataclass(frozen=True)
class Part:
    source: str | None  # None: the Gutenberg default
    weight: float | None  # None: every block once


def parse_mixture(source) -> list[Part] | None:
    """The parts of a mixture, or None when ``source`` is a single source (an existing path is
    always a single source, commas or not)."""
    if not isinstance(source, str) or ("," not in source and "=" not in source):
        return None
    if Path(source).expanduser().exists():
        return None
    parts = []
    for item in source.split(","):
        item = item.strip()
        name, eq, weight = item.rpartition("=")
        if not eq:
            name, weight = item, None
        if not name.strip():
            raise LinearizeError(f"bad mixture {source!r}: an empty source; expected {SYNTAX}")
        if weight is not None:
            try:
                weight = float(weight)
            except ValueError:
                raise LinearizeError(f"bad mixture {source!r}: weight {weight!r} of {name} is not a number; "
                                     f"expected {SYNTAX}") from None
            if not (math.isfinite(weight) and weight > 0):
                raise LinearizeError(f"bad mixture {source!r}: weight {weight} of {name} must be positive")
        parts.append(Part(name.strip(), weight))
    if len({p.weight is None for p in parts}) != 1:
        raise LinearizeError(f"bad mixture {source!r}: give every source a weight or none; expected {SYNTAX}")
    names = [p.source for p in parts]
    if len(set(names)) != len(names):
        raise LinearizeError(f"bad mixture {source!r}: a source is listed twice")
    return [Part(None if p.source == "gutenberg" else p.source, p.weight) for p in parts]


def mix(parts: list[Part], blocks: list[torch.Tensor], split: str, seed: int) -> torch.Tensor:
    """One split of the mixture from each part's blocks of that split (see the module docstring)."""
    import torch

    sizes = [b.shape[0] for b in blocks]
    weighted = parts[0].weight is not None
    shares = [p.weight for p in parts] if weighted else [float(n) for n in sizes]
    if split == "validation":
        return interleave(blocks, shares)
    if not weighted:
        return interleave(blocks, shares)
    total, whole = sum(sizes), sum(shares)
    taken = []
    for i, (b, share) in enumerate(zip(blocks, shares)):
        count = max(1, round(share / whole * total))
        copies, rest = divmod(count, b.shape[0])
        generator = torch.Generator().manual_seed(seed * 1_000_003 + i)
        extra = torch.randperm(b.shape[0], generator=generator)[:rest].sort().values
        taken.append(torch.cat([b.repeat(copies, 1), b[extra]]))
    return interleave(taken, [float(t.shape[0]) for t in taken])


def interleave(blocks: list[torch.Tensor], shares: list[float]) -> torch.Tensor:
    """The rows of every tensor in one order where each tensor's j-th row sits at ``(j + 1/2) / share``:
    any prefix holds the tensors in proportion to ``shares`` (while they last), each in its own order."""
    import torch

    keys = torch.cat([(torch.arange(b.shape[0], dtype=torch.float64) + 0.5) / s for b, s in zip(blocks, shares)])
    order = torch.sort(keys, stable=True).indices
    return torch.cat(blocks)[order]
