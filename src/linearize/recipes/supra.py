"""SUPRA (Mercat et al., 2024): swap in SUPRA attention (shared ReLU-MLP kernel, RoPE after it,
fixed per-head decay, GroupNorm), then train all weights (``recipes.uptrain.run``): Adam with betas
(0.9, 0.95), linear warmup, cosine decay to a floor (3e-4 -> 1e-5 for ~1B models).

Variants the paper ablates: the decay schedule (``spec.decay``), the T2R baseline (``norm: sum,
decay: none``) and the 2-step variant (``new_weights_first``: train only the new weights for that
many steps, then all).

The settings (``SupraConfig``) live in ``recipes.settings``, readable without torch.
"""

from __future__ import annotations

from .settings import SupraConfig
from .uptrain import run

__all__ = ["SupraConfig", "run"]
