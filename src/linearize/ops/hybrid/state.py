"""The LoLCATs hybrid's recurrent states, shared by the PyTorch forms (``hybrid_attention``,
``sparse_hybrid_attention``) and the Triton kernels (``hybrid_triton``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HybridState:
    keys: torch.Tensor  # [B, Hk, <=w, D] raw keys still in the window
    key_features: torch.Tensor  # [B, Hk, <=w, F]
    values: torch.Tensor  # [B, Hk, <=w, D]
    linear: torch.Tensor  # [B, Hk, 1, F, D + 1] fp32: sum over tokens older than the window
    valid: torch.Tensor  # [B, <=w] bool: False for padding tokens still in the window

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.key_features, self.values, self.linear, self.valid)

    def map(self, fn) -> "HybridState":
        """Apply ``fn`` to every tensor (e.g. to select or repeat sequences of the batch)."""
        return HybridState(*(fn(x) for x in self.tensors()))

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.tensors())


@dataclass
class SparseHybridState:
    """Decoding state of the hybrid with a sparse cache (per sequence; sizes fixed but the window's,
    which grows to ``w`` over the first tokens as the hybrid's does)."""

    keys: torch.Tensor  # [B, Hk, <=w, D] the window's raw keys
    key_features: torch.Tensor  # [B, Hk, <=w, F]
    values: torch.Tensor  # [B, Hk, <=w, D]
    valid: torch.Tensor  # [B, <=w] bool: False for padding in the window
    window_scores: torch.Tensor  # [B, Hk, <=w] priority of each window token from the last boundary
    linear: torch.Tensor  # [B, Hk, 1, F, D + 1] (fp32 or wider): the folded tokens
    cache_keys: torch.Tensor  # [B, Hk, S, D]
    cache_features: torch.Tensor  # [B, Hk, S, F]
    cache_values: torch.Tensor  # [B, Hk, S, D]
    cache_valid: torch.Tensor  # [B, Hk, S] bool: an occupied slot
    cache_scores: torch.Tensor  # [B, Hk, S] priority from the last boundary
    cache_pos: torch.Tensor  # [B, Hk, S] int64: position from the origin (ties)
    count: torch.Tensor  # [B] int64: tokens since the origin (0 before the first real token)
    # with gates (a fading linear state) only: [B, Hk, S] (as ``linear``) the log fade each cached token
    # has gathered since it left the window, applied when it is folded; None without gates
    cache_fade: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        fade = () if self.cache_fade is None else (self.cache_fade,)
        return (self.keys, self.key_features, self.values, self.valid, self.window_scores, self.linear,
                self.cache_keys, self.cache_features, self.cache_values, self.cache_valid, self.cache_scores,
                self.cache_pos, self.count, *fade)

    def map(self, fn) -> "SparseHybridState":
        """Apply ``fn`` to every tensor (each has the batch first)."""
        return SparseHybridState(*(fn(x) for x in self.tensors()))

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.tensors())
