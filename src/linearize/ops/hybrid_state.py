"""The LoLCATs hybrid's recurrent state, shared by the PyTorch forms (``hybrid_attention``) and the
Triton kernels (``hybrid_triton``)."""

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
