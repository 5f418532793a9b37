"""SUPRA (Mercat et al., 2024): swap in SUPRA attention (shared ReLU-MLP kernel, RoPE after it,
fixed per-head decay, GroupNorm), then train all weights (``recipes.uptrain.run``): Adam with betas
(0.9, 0.95), linear warmup, cosine decay to a floor (3e-4 -> 1e-5 for ~1B models).

Variants the paper ablates: the decay schedule (``spec.decay``), the T2R baseline (``norm: sum,
decay: none``) and the 2-step variant (``new_weights_first``: train only the new weights for that
many steps, then all).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from .. import convert
from .config import setting
from .uptrain import UptrainConfig, run

__all__ = ["SupraConfig", "run"]


@dataclass
class SupraConfig(UptrainConfig):
    method: str = "supra"
    out: str = "runs/supra"
    spec: dict = field(default_factory=lambda: {"kind": "supra"})
    new_weights_first: int = setting(0, "SUPRA's 2-step variant: train only the new weights (kernel, GroupNorm) "
                                        "for this many steps first")

    converts_in_place: typing.ClassVar[bool] = True
    PAPER: typing.ClassVar[dict] = {"lr": "SUPRA: 3e-4 for ~1B models", "min_lr": "SUPRA: 1e-5", "warmup_steps": "SUPRA: 1000"}

    def build(self, teacher):
        before = {id(p) for p in teacher.parameters()}
        student = convert(teacher, self.spec, keep_softmax=list(self.keep_softmax) or None, inplace=True)
        return student, [p for p in student.parameters() if id(p) not in before], None

    def stage_before(self) -> int:
        return self.new_weights_first
