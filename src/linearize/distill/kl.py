"""``kl``: the KL divergence from the teacher's next-token distribution to the student's.

At temperature ``tau`` both distributions are ``softmax(logits / tau)``; the loss is the mean over
tokens of ``KL(p_teacher || p_student)``, times ``tau**2`` so that its gradients keep their scale as
``tau`` changes (Hinton et al., 2015). Full: over the whole vocabulary. ``top_k = k``: over the
teacher's k most likely tokens only, both distributions renormalised on them, so a student that
is the teacher still scores 0; with ``cache`` the teacher's top-k logits of every training block
are kept (on the CPU, by the block's tokens) and the teacher runs once per block, not once per
epoch. Every position of a block counts (packed blocks hold no padding).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F

from ..errors import LinearizeError
from .base import Loss, Step


def kl_from_logits(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of ``KL(softmax(teacher / tau) || softmax(student / tau))`` x tau^2; both ``[..., V]``."""
    dtype = torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)  # fp32 at least
    log_p = F.log_softmax(teacher.to(dtype) / temperature, dim=-1)
    log_q = F.log_softmax(student.to(dtype) / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean() * temperature**2


def kl_top_k(student: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``kl_from_logits`` on the teacher's top-k tokens: ``values`` are the teacher's logits at
    ``indices`` (``[..., k]``); both distributions are renormalised over those k tokens."""
    return kl_from_logits(student.gather(-1, indices), values, temperature)


@dataclasses.dataclass
class KL(Loss):
    """Capturable: the teacher's logits (or their top k) are computed eagerly, before a CUDA-graph
    replay, and enter the graph as inputs (``teacher_tensors``)."""

    name = "kl"
    needs_teacher = True
    capturable = True

    temperature: float = 1.0
    top_k: int | None = None  # None: the whole vocabulary
    cache: bool = False  # keep the teacher's top-k logits per block (needs top_k)

    def __post_init__(self):
        if not self.temperature > 0:
            raise LinearizeError(f"kl temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise LinearizeError(f"kl top_k must be a positive integer or None, got {self.top_k!r}")
        if self.cache and self.top_k is None:
            raise LinearizeError("kl cache keeps the teacher's top-k logits: give top_k too")
        self._cached: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def n_teacher_tensors(self) -> int:
        return 1 if self.top_k is None else 2

    def _teacher_top_k(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        ids = step.batch["input_ids"]
        keys = [row.cpu().numpy().tobytes() for row in ids] if self.cache else None
        if keys is not None and all(k in self._cached for k in keys):
            rows = [self._cached[k] for k in keys]
            return (torch.stack([v for v, _ in rows]).to(ids.device),
                    torch.stack([i for _, i in rows]).to(ids.device).long())
        values, indices = step.teacher_outputs().logits.topk(self.top_k, dim=-1)
        if keys is not None:
            for k, v, i in zip(keys, values, indices):
                self._cached[k] = (v.to("cpu", torch.bfloat16 if v.is_cuda else v.dtype), i.to("cpu", torch.int32))
        return values, indices

    def teacher_tensors(self, step: Step) -> tuple[torch.Tensor, ...]:
        """``(logits,)``, or ``(values, indices)`` of the teacher's top k, on the batch's device."""
        device = step.batch["input_ids"].device
        if self.top_k is None:
            return (step.teacher_outputs().logits.to(device),)
        return tuple(t.to(device) for t in self._teacher_top_k(step))

    def from_outputs(self, outputs, batch: dict, teacher: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        if self.top_k is None:
            (logits,) = teacher
            return kl_from_logits(outputs.logits, logits, self.temperature)
        values, indices = teacher
        return kl_top_k(outputs.logits, values, indices, self.temperature)

    def __call__(self, step: Step) -> torch.Tensor:
        return self.from_outputs(step.outputs(), step.batch, self.teacher_tensors(step))
