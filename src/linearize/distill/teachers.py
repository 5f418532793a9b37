"""Where the teacher's outputs come from, for the losses that compare with them (``kl``, ``hidden_mse``).

- ``SameModelTeacher``: the student itself with every mixer swapped back to the softmax attention
  of its own projections and PEFT adapters off (``probes.softmax_view``). Exact, and costs no
  memory, while the projections are still the teacher's: LoLCATs (stage 1 trains only feature
  maps, stage 2 trains LoRA adapters beside the frozen projections), SUPRA before its weights move.
- ``FrozenTeacher``: a separate frozen model (a copy of the teacher made before conversion, or any
  model with the same tokenizer), kept in ``dtype`` (bf16 on CUDA by default), never trained.
  What XATL needs (its mixers have their own projections) and SUPRA once all weights train.

Either is called as ``teacher(model, input_ids, inputs_of, outputs_of, attention_of) -> TeacherOutputs``,
under ``torch.no_grad``; ``inputs_of`` / ``outputs_of`` name decoder layers whose input / output hidden
states the losses read, ``attention_of`` those whose attention output (before the residual) they read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from ..models import get_adapter
from .hooks import recording
from .probes import softmax_view, unwrap


@dataclass
class TeacherOutputs:
    logits: torch.Tensor
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> hidden states entering it
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> hidden states leaving it
    attention: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> its attention's output


def _forward(model: nn.Module, input_ids, inputs_of, outputs_of, attention_of=()) -> TeacherOutputs:
    adapter = get_adapter(unwrap(model).config)
    layers = dict(enumerate(adapter.layers(unwrap(model))))
    attention = {i: adapter.attention(layers[i]) for i in attention_of}
    with recording(layers, inputs_of, outputs_of) as (ins, outs), recording(attention, (), attention_of) as (_, attn):
        logits = model(input_ids=input_ids, use_cache=False).logits
    return TeacherOutputs(logits, {i: x.detach() for i, x in ins.items()}, {i: x.detach() for i, x in outs.items()},
                          {i: x.detach() for i, x in attn.items()})


class SameModelTeacher:
    """The student as its own teacher (softmax attention from its projections, LoRA off)."""

    kind = "same"

    @torch.no_grad()
    def __call__(self, model, input_ids, inputs_of=(), outputs_of=(), attention_of=()) -> TeacherOutputs:
        outer = getattr(model, "module", model)  # not through DDP: nothing here is trained
        with softmax_view(outer):  # LoRA layers read the disabled flag, so the inner model skips them too
            return _forward(unwrap(model), input_ids, inputs_of, outputs_of, attention_of)


class FrozenTeacher:
    """A separate model, frozen, in ``dtype`` (None: bf16 on CUDA, as it is elsewhere).

    ``shard``: under several processes (a recipe launched with accelerate's FSDP config), shard it
    with FSDP2 at its first call (one unit per decoder layer, over the default process group), so each
    process holds 1/N of its weights between forwards, as it does of the student's."""

    kind = "copy"

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None, copy_model: bool = True,
                 shard: bool = False):
        self.shard, self.sharded = shard, False
        model = copy.deepcopy(model) if copy_model else model
        device = next(model.parameters()).device
        if dtype is None and device.type == "cuda":
            dtype = torch.bfloat16
        if dtype is not None:
            model = model.to(dtype)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model

    @torch.no_grad()
    def __call__(self, model, input_ids, inputs_of=(), outputs_of=(), attention_of=()) -> TeacherOutputs:
        if self.shard and not self.sharded:
            shard_frozen(self.model)  # here, not at construction: the process group exists by now
            self.sharded = True
        device = next(self.model.parameters()).device
        out = _forward(self.model, input_ids.to(device), inputs_of, outputs_of, attention_of)
        if self.sharded and hasattr(self.model, "reshard"):
            self.model.reshard()  # FSDP keeps the root unit gathered after a forward (for a backward)
        return out


def shard_frozen(model: nn.Module) -> None:
    """Shard ``model`` in place with FSDP2 over the default process group: each decoder layer one unit
    (gathered for its forward, freed after), the rest (embeddings, head, final norm) the root unit.
    Every process calls it; a single process (no group, or a group of one) leaves the model whole."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in get_adapter(model.config).layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


TEACHER_FORMS = ("same", "copy")


def make_teacher(form: str, teacher: nn.Module | None = None):
    """``same`` -> ``SameModelTeacher()``; ``copy`` -> a ``FrozenTeacher`` copy of ``teacher``."""
    if form == "same":
        return SameModelTeacher()
    if form == "copy":
        return FrozenTeacher(teacher)
    from ..errors import LinearizeError

    raise LinearizeError(f"distill_teacher must be one of {', '.join(TEACHER_FORMS)}, got {form!r}")
