"""XATL (Chen et al., 2024): build an LCI architecture of the teacher's shape from its shared weights
(``linearize.xatl.build_xatl``: RetNet retention or Mamba in each block, optionally softmax kept at
some layers: ``keep_softmax``, the name every recipe uses; "xatl" is the paper's layers 2 and N/2) and train it (``recipes.uptrain.run``) with the transferred weights frozen, unfrozen, or
LIT (frozen until validation stops improving by ``lit_threshold``, then unfrozen) — AdamW betas
(0.9, 0.95), weight decay 0.1, cosine 3e-4 -> 3e-5.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from ..errors import LinearizeError
from .config import setting
from .launch import world_size
from .uptrain import UptrainConfig, run

__all__ = ["XatlConfig", "run"]


@dataclass
class XatlConfig(UptrainConfig):
    method: str = "xatl"
    out: str = "runs/xatl"
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    arch: str = setting("retnet", "the new token mixer (default: retnet)", choices=("retnet", "striped_mamba"))
    transfer: tuple[str, ...] | str | None = setting(
        None, "comma-separated: embeddings, ffn, wo, attention (the kept softmax layers), qkv (RetNet: the "
              "retention's q/k/v from the teacher's attention); or 'scratch' (default: embeddings,ffn,wo for "
              "retnet, embeddings,ffn for mamba)")
    keep_softmax: tuple[int, ...] | str = ()  # layer indices, or "xatl": layers 2 and N/2 (the paper's hybrid)
    freeze: str = setting("unfrozen", "transferred weights (default: unfrozen)", choices=("frozen", "unfrozen", "lit"))
    lit_threshold: float = setting(0.01, "LIT: unfreeze when validation improves by less than this (0.01)")
    lit_patience: int = setting(1, "LIT: evaluations below the threshold before unfreezing (1)")

    PAPER: typing.ClassVar[dict] = {"lr": "XATL: 3e-4", "min_lr": "XATL: 3e-5", "warmup_steps": "XATL: 2000",
                                    "weight_decay": "XATL: 0.1"}

    def check(self) -> None:
        from ..xatl import ARCHITECTURES, resolve_transfer

        if isinstance(self.keep_softmax, str) and self.keep_softmax != "xatl":
            raise LinearizeError(f"keep_softmax {self.keep_softmax!r}: give layer indices (e.g. 2,15) or 'xatl' "
                                 "(layers 2 and N/2)")
        resolve_transfer(self.transfer, ARCHITECTURES.get(self.arch, self.arch), (0,) if self.keep_softmax else ())

    def graphs_blocked(self) -> str | None:
        if self.freeze == "lit" and world_size() > 1:
            return ("under torchrun the step is captured once, before training, and LIT's unfreezing needs a new "
                    "capture (one GPU can graph LIT)")
        return None

    def build(self, teacher):
        from ..xatl import build_xatl

        keep = self.keep_softmax if self.keep_softmax == "xatl" else (list(self.keep_softmax) or None)
        student, report = build_xatl(teacher, self.arch, transfer=self.transfer, keep_softmax=keep, seed=self.seed)
        return student, [], report

    def callbacks(self) -> list:
        from pathlib import Path

        from ..lit import LitCallback

        # the transferred tensors come from the XATL record in the student's config; LIT's unfreezing is a
        # line in the run's metrics.jsonl, and its record goes into results.json (``freeze``)
        return [LitCallback(mode=self.freeze, threshold=self.lit_threshold, patience=self.lit_patience,
                            log_path=str(Path(self.out) / "metrics.jsonl"))]
