"""``mixer_mse``: each new mixer's output against the teacher's attention output at its layer, teacher-forced.

Every chosen layer gets the teacher's hidden states entering it, so each mixer sees what the
teacher's attention saw (through the layer's own input norm) and its output, before the residual,
is compared with the teacher's attention output there (MSE); the loss is ``factor`` x the mean over
layers. This is the alignment stage of RADLADS and MOHAWK, and works where LoLCATs' probes cannot:
for mixers with their own projections (XATL) or whose projections have moved (SUPRA uptraining),
with a frozen copy of the teacher. ``layers``: None for every layer with a mixer. The student's
forward stops after the last chosen layer (nothing after it is needed).
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
from .hooks import StopForward, injecting, recording
from .probes import fully_sharded


@dataclasses.dataclass
class MixerMSE(Loss):
    name = "mixer_mse"
    needs_teacher = True

    layers: tuple[int, ...] | None = None
    factor: float = 1.0

    def __post_init__(self):
        if self.factor < 0:
            raise LinearizeError(f"mixer_mse factor must be >= 0, got {self.factor}")

    def chosen(self, model) -> list[int]:
        layers = sorted(mixers(model)) if self.layers is None else sorted(self.layers)
        if not layers:
            raise LinearizeError("mixer_mse: no layer to align (the model has no mixer; name layers)")
        return layers

    def teacher_capture(self, model):
        return set(self.chosen(model)), set()

    def teacher_attention(self, model):
        return set(self.chosen(model))

    def __call__(self, step: Step) -> torch.Tensor:
        inner = step.student
        chosen = self.chosen(inner)
        adapter = get_adapter(inner.config)
        layer_list = adapter.layers(inner)
        bad = [i for i in chosen if not 0 <= i < len(layer_list)]
        if bad:
            raise LinearizeError(f"mixer_mse: layers {bad} out of range: the model has layers 0..{len(layer_list) - 1}")
        teacher = step.teacher_outputs()
        attention = {i: adapter.attention(layer_list[i]) for i in chosen}
        # under FSDP the whole forward runs and the backward passes through every layer (see below)
        sharded = fully_sharded(step.model)
        out = None
        with ExitStack() as stack:
            for i in chosen:
                stack.callback(injecting(layer_list[i], {"hidden": teacher.inputs[i]}, tie=sharded).remove)
            _, outs = stack.enter_context(recording(attention, outputs=chosen,
                                                    stop_after=None if sharded else chosen[-1]))
            try:
                out = step.model(input_ids=step.batch["input_ids"], use_cache=False)
            except StopForward:
                pass
        errors = [F.mse_loss(outs[i].float(), teacher.attention[i].to(outs[i].device).float()) for i in chosen]
        loss = self.factor * torch.stack(errors).mean()
        if sharded and out is not None:
            # FSDP gathers a layer's weights for its backward from hooks on the layer's output, and the MSE
            # leaves each layer inside it: a term of weight 0 on the logits runs the backward through every
            # layer's output (the injected inputs are tied to the layers below), so each layer is gathered
            # before its mixer's gradient needs its weights (as attention_mse does)
            loss = loss + 0.0 * out.logits.float().mean()
        return loss
