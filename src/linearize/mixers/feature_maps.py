"""Feature maps phi: [B, heads, T, D] -> [B, heads, T, F], learnable per head.

A map built with ``n_heads=1`` shares its weights across heads (SUPRA's shared kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _eye_init(n_heads: int, in_dim: int, out_dim: int) -> torch.Tensor:
    """Per-head (rectangular) identity: a trained-from-here map starts as a plain projection."""
    return torch.eye(in_dim, out_dim).expand(n_heads, in_dim, out_dim).clone()


def _shared_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x @ w + b`` for one ``[D, F]`` weight shared by every head: a single 2-D product (bias fused)
    over the rows of ``x`` in the order they are stored, so a ``[B, H, T, D]`` view of ``[B, T, H, D]``
    storage (what the q/k projections give, and fla's layout) is read without a copy and the result
    keeps that layout. A batched product over heads would copy ``x`` to ``[B, H, T, D]`` first."""
    xt = x.transpose(1, 2)
    rows = xt if xt.is_contiguous() else x
    flat = rows.reshape(-1, rows.shape[-1])
    y = (flat @ w if b is None else torch.addmm(b.view(-1), flat, w)).view(*rows.shape[:-1], -1)
    return y.transpose(1, 2) if rows is xt else y


class FeatureMap(nn.Module):
    out_dim: int

    def extra_repr(self) -> str:
        return f"out_dim={self.out_dim}"


class EluPlusOne(FeatureMap):
    """elu(x) + 1 (Katharopoulos et al.): positive, no parameters."""

    def __init__(self, n_heads: int, head_dim: int, feature_dim: int):
        super().__init__()
        self.out_dim = head_dim

    def forward(self, x):
        return F.elu(x) + 1


class ReLUMap(FeatureMap):
    """relu(x): no parameters."""

    def __init__(self, n_heads: int, head_dim: int, feature_dim: int):
        super().__init__()
        self.out_dim = head_dim

    def forward(self, x):
        return F.relu(x)


class _Projected(FeatureMap):
    def __init__(self, n_heads: int, head_dim: int, feature_dim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(_eye_init(n_heads, head_dim, feature_dim))
        self.bias = nn.Parameter(torch.zeros(n_heads, 1, feature_dim)) if bias else None

    def project(self, x):
        w = self.weight.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        if w.shape[0] == 1:
            return _shared_product(x, w.squeeze(0), b)
        y = x @ w  # [B, H, T, D] @ [H, D, F] broadcasts per head
        return y if b is None else y + b


class T2R(_Projected):
    """ReLU(xW + b) (Kasai et al., T2R; SUPRA's kernel when square and shared)."""

    def __init__(self, n_heads: int, head_dim: int, feature_dim: int):
        super().__init__(n_heads, head_dim, feature_dim, bias=True)
        self.out_dim = feature_dim

    def forward(self, x):
        return F.relu(self.project(x))


class Hedgehog(_Projected):
    """[softmax(xW) | softmax(-xW)] over the feature dimension (Zhang et al., Hedgehog; LoLCATs)."""

    def __init__(self, n_heads: int, head_dim: int, feature_dim: int):
        super().__init__(n_heads, head_dim, feature_dim, bias=False)
        self.out_dim = 2 * feature_dim

    def forward(self, x):
        y = self.project(x)
        return torch.cat([torch.softmax(y, dim=-1), torch.softmax(-y, dim=-1)], dim=-1)


FEATURE_MAPS: dict[str, type[FeatureMap]] = {"elu": EluPlusOne, "relu": ReLUMap, "t2r": T2R, "hedgehog": Hedgehog}


def build_feature_map(name: str, n_heads: int, head_dim: int, feature_dim: int) -> FeatureMap:
    return FEATURE_MAPS[name](n_heads, head_dim, feature_dim)
