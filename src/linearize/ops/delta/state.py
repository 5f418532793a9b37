"""The delta hybrid's decoding states: one per form that decodes.

* ``DeltaWindowState``: the window's tokens (raw keys and values for the softmax, delta keys and gates for
  their write when they leave) and the memory; what ``delta_window_step`` and a prefill leave.
* ``RingDeltaState``: the same with the window as a fixed ring of ``w`` slots, updated in place (the fast
  decoder's, for ``delta_window_step_ring``).
* ``FusedRingDeltaState``: the ring laid out for the fused Triton step (``step_triton.py``), whose
  programs (one per sequence and key head) each own their bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..hybrid.shared import pad_front
from ..linear_attention import accum_dtype
from .rule import empty_delta_state


@dataclass
class DeltaWindowState:
    """Decoding state of the window + delta-rule hybrid: the window's tokens (raw keys and values for
    the softmax, delta keys and gates for their write when they leave) and the memory."""

    keys: torch.Tensor  # [B, Hk, <=w, D]
    values: torch.Tensor  # [B, Hk, <=w, D]
    delta_keys: torch.Tensor  # [B, Hk, <=w, K]
    gates: torch.Tensor  # [B, Hk, <=w] log decay g
    betas: torch.Tensor  # [B, Hk, <=w]
    valid: torch.Tensor  # [B, <=w] bool
    memory: torch.Tensor  # [B, Hk, K, V] fp32 or wider
    written: torch.Tensor  # [B] bool: a real token has reached the memory

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.values, self.delta_keys, self.gates, self.betas, self.valid, self.memory, self.written)

    def map(self, fn) -> "DeltaWindowState":
        return DeltaWindowState(*(fn(x) for x in self.tensors()))

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.tensors())


def empty_delta_window_state(batch, n_kv, head_dim, key_dim, *, device=None, dtype=torch.float32) -> DeltaWindowState:
    acc = accum_dtype(dtype)
    z = lambda *s, dt=dtype: torch.zeros(batch, n_kv, *s, device=device, dtype=dt)  # noqa: E731
    return DeltaWindowState(z(0, head_dim), z(0, head_dim), z(0, key_dim), z(0, dt=acc), z(0, dt=acc),
                            torch.zeros(batch, 0, dtype=torch.bool, device=device),
                            empty_delta_state(batch, n_kv, key_dim, head_dim, device=device, dtype=dtype),
                            torch.zeros(batch, dtype=torch.bool, device=device))


@dataclass
class RingDeltaState(DeltaWindowState):
    """A ``DeltaWindowState`` whose window is a fixed ring of exactly ``w`` slots, updated in place
    (the fast decoder's buffers; as ``RingHybridState`` for LoLCATs). The window's softmax does not
    depend on the order of its keys, so a new token overwrites the oldest slot after that token has
    been written to the memory. Empty slots hold zeros, ``valid = False`` and ``g = b = 0`` (writing
    one leaves the memory as it is); ``slot`` (0-d long) is the next slot to overwrite."""

    slot: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*super().tensors(), self.slot)

    def map(self, fn) -> "RingDeltaState":
        return RingDeltaState(*(fn(x) for x in super().tensors()), slot=self.slot.clone())

    @classmethod
    def from_state(cls, state: DeltaWindowState, window: int) -> "RingDeltaState":
        """A ring of ``window`` slots holding ``state``'s window, oldest first with the empty slots in
        front (overwriting slots 0, 1, ... evicts tokens in the order they came). Takes over
        ``state``'s memory: ``state`` must not be used afterwards."""
        have = state.keys.shape[2]
        if have > window:
            raise ValueError(f"the state holds {have} window tokens, more than the window ({window})")
        pad = window - have
        valid = pad_front(state.valid, 1, pad)
        keep = valid[:, None, :]
        front = lambda x: (pad_front(x, 2, pad) * (keep[..., None] if x.dim() == 4 else keep)).contiguous()  # noqa: E731
        slot = torch.zeros((), dtype=torch.long, device=state.keys.device)
        return cls(front(state.keys), front(state.values), front(state.delta_keys), front(state.gates),
                   front(state.betas), valid.contiguous(), state.memory.contiguous(), state.written.clone(), slot=slot)


@dataclass
class FusedRingDeltaState(DeltaWindowState):
    """A ``RingDeltaState`` laid out for the fused step (``step_triton.delta_step_fused_triton``): its programs
    run at once, one per (sequence, key head), so each key head keeps its own bookkeeping and no program reads
    what another writes: ``valid`` ``[B, Hk, w]``, ``written`` ``[B, Hk]`` and ``ticks`` ``[B, Hk]`` (the next
    slot to overwrite), all advanced inside the launch."""

    ticks: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*super().tensors(), self.ticks)

    def map(self, fn) -> "FusedRingDeltaState":
        return FusedRingDeltaState(*(fn(x) for x in self.tensors()))

    @classmethod
    def from_ring(cls, ring: RingDeltaState) -> "FusedRingDeltaState":
        """The fused layout of ``ring``, whose buffers it takes over."""
        b, hk = ring.keys.shape[:2]
        per_head = lambda x: x.unsqueeze(1).expand(b, hk, *x.shape[1:]).contiguous()  # noqa: E731
        return cls(ring.keys, ring.values, ring.delta_keys, ring.gates, ring.betas, per_head(ring.valid),
                   ring.memory, per_head(ring.written), ticks=ring.slot.expand(b, hk).contiguous())
