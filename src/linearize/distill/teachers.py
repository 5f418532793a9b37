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
import itertools
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
    process holds 1/N of its weights between forwards, as it does of the student's. Until then the
    weights wait on the CPU (a copy is made there tensor by tensor; a model kept as it is moves there)
    and ``fully_shard`` moves each unit to the process's device as it shards it: no GPU holds the
    whole teacher a second time, only one unit at a time."""

    kind = "copy"

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None, copy_model: bool = True,
                 shard: bool = False):
        self.shard, self.sharded = shard, False
        device = next(model.parameters()).device
        # bf16 where the teacher runs on CUDA: on its device, or (shard) on the process's GPU that
        # fully_shard moves it to from the CPU, where a recipe under FSDP loaded it
        if dtype is None and (device.type == "cuda" or (shard and torch.cuda.is_available())):
            dtype = torch.bfloat16
        if shard:  # the weights wait on the CPU until fully_shard takes them (shard_frozen)
            model = _copy_on_cpu(model, dtype) if copy_model else model.to("cpu", dtype)
        else:
            model = copy.deepcopy(model) if copy_model else model
            if dtype is not None:
                model = model.to(dtype)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model

    @torch.no_grad()
    def __call__(self, model, input_ids, inputs_of=(), outputs_of=(), attention_of=()) -> TeacherOutputs:
        if self.shard and not self.sharded:
            # here, not at construction: the process group exists by now, and the batch is on the device
            shard_frozen(self.model, input_ids.device)
            self.sharded = True
        device = next(self.model.parameters()).device
        out = _forward(self.model, input_ids.to(device), inputs_of, outputs_of, attention_of)
        if self.sharded and hasattr(self.model, "reshard"):
            self.model.reshard()  # FSDP keeps the root unit gathered after a forward (for a backward)
        return out


def _copy_on_cpu(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A deep copy of ``model`` with its parameters and buffers copied to the CPU one at a time (never a
    second whole model on ``model``'s device), floating-point ones cast to ``dtype`` on the way (None:
    kept); weights tied in ``model`` stay tied in the copy."""
    memo = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) not in memo:
            on_cpu = t.detach().to("cpu", dtype if dtype is not None and t.is_floating_point() else t.dtype, copy=True)
            memo[id(t)] = nn.Parameter(on_cpu, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else on_cpu
    return copy.deepcopy(model, memo)  # deepcopy takes each tensor's copy from the memo


def shard_frozen(model: nn.Module, device: torch.device) -> None:
    """Shard ``model`` in place with FSDP2 over the default process group, onto ``device``: each decoder
    layer one unit (gathered for its forward, freed after), the rest (embeddings, head, final norm)
    the root unit. ``fully_shard`` moves a unit's weights (which may wait on the CPU) to ``device``
    as it shards them. Every process calls it; a single process (no group, or a group of one) moves
    the model whole to ``device``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        model.to(device)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
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
