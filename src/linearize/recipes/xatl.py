"""XATL (Chen et al., 2024): build an LCI architecture of the teacher's shape from its shared weights
(``linearize.convert.xatl_transfer.build_xatl``: RetNet retention or Mamba in each block, optionally softmax kept at
some layers: ``keep_softmax``, the name every recipe uses; "xatl" is the paper's layers 2 and N/2) and train it (``recipes.uptrain.run``) with the transferred weights frozen, unfrozen, or
LIT (frozen until validation stops improving by ``lit_threshold``, then unfrozen) — AdamW betas
(0.9, 0.95), weight decay 0.1, cosine 3e-4 -> 3e-5.

The settings (``XatlConfig``) live in ``recipes.settings``, readable without torch.
"""

from __future__ import annotations

from .settings import XatlConfig
from .uptrain import run

__all__ = ["XatlConfig", "run"]
