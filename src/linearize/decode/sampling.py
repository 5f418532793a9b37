"""How the fast decoder picks the next token, entirely on the device (no host sync, graph-safe).

Greedy is an argmax; sampling applies temperature, top-k and top-p and then draws from ``p`` as
``argmax(p / E)`` with ``E ~ Exp(1)`` (a draw from ``p`` without a host round trip).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LinearizeError


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked. ``do_sample=False`` is greedy (argmax)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.do_sample:
            if not self.temperature > 0:
                raise LinearizeError(f"temperature must be > 0 when sampling, got {self.temperature}")
            if self.top_k is not None and self.top_k < 1:
                raise LinearizeError(f"top_k must be a positive integer, got {self.top_k}")
            if self.top_p is not None and not 0 < self.top_p <= 1:
                raise LinearizeError(f"top_p must be in (0, 1], got {self.top_p}")


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``[B, V]`` float logits after temperature, top-k and top-p (removed tokens at -inf)."""
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked before it already reach top_p (the first always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``[B]`` next tokens from ``[B, V]`` logits, entirely on the device."""
    logits = logits.float()
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits, sampling), dim=-1)
    race = torch.empty_like(probs).exponential_(1.0)  # argmax(p / Exp(1)) is a draw from p
    return (probs / race).argmax(dim=-1)
