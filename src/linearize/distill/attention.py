"""``attention_mse``: LoLCATs attention transfer (stage 1), and Hedgehog's attention cross-entropy.

Each trained layer's output is compared with the softmax attention it replaced, on the same input
(teacher-forced: every layer passes the teacher's output on), through ``AttentionTransferProbe``
wrappers put in place for the forward (``probes.transfer_probes``): q/k/v are projected once, and
the converted layers outside ``layers`` give the teacher's output. The loss is ``mse_factor`` x the
mean over ``layers`` of the output MSE (1000 in the LoLCATs code), plus ``xent_factor`` x the mean
cross-entropy of their attention weights to the teacher's (LoLCATs: 0; quadratic memory in T).

The loss runs the student's forward itself and reads no teacher tensors (the teacher is the
student's own projections), so a CUDA graph captures the whole call (``captured_whole``;
``linearize.graphed``): the probes are swapped in and out while the graph is captured, and each
replay runs the kernels they issued then.
"""

from __future__ import annotations

import dataclasses

import torch

from ..convert import mixers
from ..errors import LinearizeError
from .base import Loss, Step
from .hooks import StopForward
from .probes import fully_sharded, transfer_probes, unwrap


def _stop_hook(module):
    def hook(mod, args, output):
        raise StopForward
    return module.register_forward_hook(hook)


@dataclasses.dataclass
class AttentionMSE(Loss):
    name = "attention_mse"
    captured_whole = True

    layers: tuple[int, ...] | None = None  # None: every converted layer
    mse_factor: float = 1.0
    xent_factor: float = 0.0
    stop_early: bool = True  # end the forward after the last trained layer (single process only)

    def __post_init__(self):
        if self.mse_factor < 0 or self.xent_factor < 0:
            raise LinearizeError(f"attention_mse factors must be >= 0, got mse {self.mse_factor}, xent {self.xent_factor}")

    def __call__(self, step: Step) -> torch.Tensor:
        inner = step.student
        layers = sorted(self.layers) if self.layers is not None else sorted(mixers(inner))
        if not layers:
            raise LinearizeError("attention_mse: the model has no converted layer to train")
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        # FSDP needs each prediction tied to its layer's output (below); data-parallel training does not: DDP
        # (no search for unused parameters) and the graphed runs' all-reduce wait for every trained parameter's
        # gradient, which the MSE gives. Untied, the layers after a probe keep no activations (8B under DDP:
        # 84 GB a GPU in stage 1 tied, against 55 GB on one GPU)
        with transfer_probes(inner, layers, with_xent=self.xent_factor > 0, tie=fully_sharded(step.model)) as probes:
            missing = [i for i in layers if i not in probes]
            if missing:
                raise LinearizeError(f"attention_mse: layers {missing} are not converted layers of this model")
            # later layers are not needed (their input is the teacher's): cut the forward there
            hook = _stop_hook(probes[layers[-1]]) if self.stop_early and not distributed else None
            out = None
            try:
                out = step.model(input_ids=step.batch["input_ids"], use_cache=False)
            except StopForward:
                pass
            finally:
                if hook is not None:
                    hook.remove()
        loss = self.mse_factor * torch.stack([probes[i].mse for i in layers]).mean()
        if self.xent_factor:
            loss = loss + self.xent_factor * torch.stack([probes[i].xent for i in layers]).mean()
        if out is not None and fully_sharded(step.model):
            # FSDP gathers a layer's weights for its backward from hooks on the layer's outputs (and
            # reduces the gradients from the model's): the MSE leaves each layer before them. A term of
            # weight 0 on the logits runs the backward through every layer's output, and the probes tie
            # each mixer's prediction to that output, so each layer is gathered before its MSE's
            # gradient needs its weights. Cost: a backward pass of zeros through the model.
            loss = loss + 0.0 * out.logits.float().mean()
        return loss


@torch.no_grad()
def layer_mse(student, blocks: torch.Tensor, batch_size: int = 4) -> dict[int, float]:
    """Each converted layer's attention-output MSE to the teacher on ``blocks`` (teacher-forced)."""
    inner = unwrap(student)
    converted = sorted(mixers(inner))
    device = next(inner.parameters()).device
    sums = {i: 0.0 for i in converted}
    n = 0
    for s in range(0, len(blocks), batch_size):
        with transfer_probes(inner, converted) as probes:
            inner(input_ids=blocks[s : s + batch_size].to(device), use_cache=False)
        for i in converted:
            sums[i] += probes[i].mse.item()
        n += 1
    return {i: v / max(n, 1) for i, v in sums.items()}
