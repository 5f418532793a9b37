"""The next-token loss: mean cross-entropy of the student's predictions on packed blocks."""

from __future__ import annotations

import dataclasses

import torch

from .base import Loss


def next_token_loss(model, batch) -> torch.Tensor:
    """Mean next-token cross-entropy of a batch of packed blocks (the engine's loss signature)."""
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss


@dataclasses.dataclass
class NextToken(Loss):
    """``next_token``: the student's own language-modelling loss (SUPRA and XATL uptraining,
    LoLCATs stage 2). Read off the student's forward, so a CUDA graph can replay it."""

    name = "next_token"
    capturable = True

    def __call__(self, step) -> torch.Tensor:
        return step.outputs().loss

    def from_outputs(self, outputs, batch, teacher=()) -> torch.Tensor:
        return outputs.loss
