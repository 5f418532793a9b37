"""Fixed per-head decays, as log g_h (<= 0), one per query head."""

from __future__ import annotations

import math

import torch


def retnet_log_decay(n_heads: int) -> torch.Tensor:
    """RetNet's multi-scale retention: g_h = 1 - 2^(-5-h)."""
    return torch.log1p(-(2.0 ** (-5.0 - torch.arange(n_heads, dtype=torch.float64)))).float()


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi's head slopes: a geometric sequence from 2^(-8/n); non-powers of two interleave two sequences."""
    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_two(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]


def lightning_log_decay(n_heads: int, layer_idx: int, n_layers: int) -> torch.Tensor:
    """Lightning attention / TransNormerLLM: slope_h * (1 - l/(L-1) + 1e-5); deeper layers decay less."""
    depth = 1 - layer_idx / max(n_layers - 1, 1) + 1e-5
    return -torch.tensor(alibi_slopes(n_heads), dtype=torch.float32) * depth


def log_decay(kind: str, n_heads: int, layer_idx: int, n_layers: int,
              horizon: int | None = None) -> torch.Tensor | None:
    """The fixed decay ``kind`` per query head; ``horizon``: no head keeps a longer horizon ``1 / -log g``
    than that many tokens (a decay of ``none`` becomes ``exp(-1 / horizon)`` on every head), so no head
    holds its keys over distances training never showed it."""
    if kind == "none":
        decay = None
    elif kind == "retnet":
        decay = retnet_log_decay(n_heads)
    elif kind == "lightning":
        decay = lightning_log_decay(n_heads, layer_idx, n_layers)
    else:
        raise ValueError(f"unknown decay {kind!r}")
    if horizon is None:
        return decay
    cap = torch.full((n_heads,), -1.0 / horizon)
    return cap if decay is None else torch.minimum(decay, cap)
