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
        y = x @ self.weight.to(x.dtype)  # [B, H, T, D] @ [H, D, F] broadcasts per head (or shared when H=1)
        return y if self.bias is None else y + self.bias.to(x.dtype)


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
