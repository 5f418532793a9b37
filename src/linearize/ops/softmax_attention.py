"""The teacher's function: causal softmax attention with the teacher's scale, soft-cap and window.

Used by attention transfer (LoLCATs stage 1) to compute the target each mixer learns to match
from the very same queries, keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_attention(q, k, v, *, scale: float, softcap: float | None = None, window: int | None = None):
    """q ``[B, H, T, D]``, k/v ``[B, Hk, T, D]`` (grouped keys are broadcast, not copied by SDPA)."""
    if softcap is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    weights = softmax_attention_weights(q, k, scale=scale, softcap=softcap, window=window)
    return weights.to(v.dtype) @ v.repeat_interleave(q.shape[1] // k.shape[1], 1)


def softmax_attention_weights(q, k, *, scale: float, softcap: float | None = None, window: int | None = None):
    """The teacher's attention weights ``[B, H, T, T]`` (fp32), e.g. for LoLCATs' cross-entropy."""
    t = q.shape[2]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(t, device=q.device)
    dist = pos[:, None] - pos[None, :]
    allowed = dist >= 0 if window is None else (dist >= 0) & (dist < window)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
