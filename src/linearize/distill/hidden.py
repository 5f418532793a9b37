"""``hidden_mse``: align the student's hidden states with the teacher's, layer by layer or block by block.

Each group of ``block`` consecutive layers (1: every layer alone) gets the teacher's hidden states
entering its first layer (teacher-forced) and its output, the hidden states leaving its last layer,
is compared with the teacher's there (MSE); the loss is ``factor`` x the mean over groups. With
``teacher_forced=False`` the student runs freely and only the comparisons remain. ``layers``
(None: every layer with a mixer) must be in increasing order; groups are cut from them as given.
Works for any student with the teacher's layer count: converted (LoLCATs, SUPRA) or built (XATL).
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack

import torch
from torch.nn import functional as F

from ..convert import mixers
from ..errors import LinearizeError
from ..models import get_adapter
from .base import Loss, Step
from .hooks import injecting, recording


@dataclasses.dataclass
class HiddenMSE(Loss):
    name = "hidden_mse"
    needs_teacher = True

    layers: tuple[int, ...] | None = None
    block: int = 1
    teacher_forced: bool = True
    factor: float = 1.0

    def __post_init__(self):
        if not isinstance(self.block, int) or self.block < 1:
            raise LinearizeError(f"hidden_mse block must be a positive integer, got {self.block!r}")
        if self.factor < 0:
            raise LinearizeError(f"hidden_mse factor must be >= 0, got {self.factor}")

    def groups(self, model) -> list[list[int]]:
        layers = sorted(mixers(model)) if self.layers is None else list(self.layers)
        if not layers:
            raise LinearizeError("hidden_mse: no layer to align (the model has no mixer; name layers)")
        return [layers[i : i + self.block] for i in range(0, len(layers), self.block)]

    def teacher_capture(self, model):
        groups = self.groups(model)
        return ({g[0] for g in groups} if self.teacher_forced else set()), {g[-1] for g in groups}

    def __call__(self, step: Step) -> torch.Tensor:
        inner = step.student
        groups = self.groups(inner)
        teacher = step.teacher_outputs()
        layer_list = get_adapter(inner.config).layers(inner)
        layers = dict(enumerate(layer_list))
        bad = [i for g in groups for i in g if i not in layers]
        if bad:
            raise LinearizeError(f"hidden_mse: layers {bad} out of range: the model has layers 0..{len(layer_list) - 1}")
        with ExitStack() as stack:
            if self.teacher_forced:
                for g in groups:
                    current = {"hidden": teacher.inputs[g[0]]}
                    stack.callback(injecting(layers[g[0]], current).remove)
            ins, outs = stack.enter_context(recording(layers, outputs=[g[-1] for g in groups]))
            step.model(input_ids=step.batch["input_ids"], use_cache=False)
        errors = [F.mse_loss(outs[g[-1]].float(), teacher.outputs[g[-1]].to(outs[g[-1]].device).float()) for g in groups]
        return self.factor * torch.stack(errors).mean()
