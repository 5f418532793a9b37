"""Float8 rings for the window-softmax layers (``spec.softmax_window_dtype = "float8"``): the window's keys and
values kept as float8 e4m3 codes with one float32 scale per token and key head, about half the bytes of bf16.

A vector ``x`` (one token's key or value of one key head) is kept as ``round_e4m3(x / s)`` with
``s = max|x| / 448`` (e4m3's largest finite value), read back as ``code * s``. The layer's sequence form attends
over keys and values read back the same way (``fake_quantize``; the gradient passes straight through), so a
prefill, a decode step and the parallel forward all see the same numbers: a float8 layer is the exact layer fed
with ``fake_quantize(k)``, ``fake_quantize(v)``.

* ``quantize`` / ``dequantize`` / ``fake_quantize``;
* ``Float8WindowState`` (the prompt's last ``window`` tokens, ``float8_window_state``) and ``Float8RingState``
  (the fast decoder's ring of ``window`` slots, ``Float8RingState.from_state``): the hybrid's states with codes
  in ``keys`` / ``values`` and the scales beside them, so the cache and the fast decoder carry them as any other;
* ``float8_window_step``: one token from a ``Float8WindowState``, through the exact step on the read-back window;
* ``float8_window_step_ring``: one token on the ring, in place: the new token's codes and scales into its slot
  and the softmax over the ring read back. On CUDA one Triton launch (``step_triton.window_step_ring_float8_triton``,
  ``FLOAT8_STEP_KERNEL``) that quantises the new token itself (bit for bit as ``quantize``), writes its codes
  and scales and reads the ring's codes as bytes: about half the bytes a bf16 ring's step reads. The window
  mixer's fast path also has it rotate q and k (``position_embeddings``). Elsewhere, and the reference,
  ``quantize``, the copies into the slot and the exact ring step on the whole ring read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..hybrid import HybridState, RingHybridState
from ..hybrid.shared import pad_front

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = 448.0  # e4m3's largest finite value

# The ring's step as one Triton launch reading the codes (``step_triton.window_step_ring_float8_triton``) where
# ``_use_float8_step_kernel`` allows: on CUDA with Triton, q in bf16, fp16 or fp32, the ring's buffers
# contiguous. False: always the PyTorch step on the read-back ring (the reference, and the CPU's path).
FLOAT8_STEP_KERNEL: bool = True


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` as float8 codes and one float32 scale per vector ``[..., 1]`` (a zero vector: codes 0).

    Both divisions are rounded as IEEE on every device: 448 is divided by as a tensor on ``x``'s device, since
    PyTorch's CUDA division by a Python number multiplies by its reciprocal (a bit off at times), and the
    float8 step's kernel (``step_triton._quantize``) divides exactly."""
    wide = x if x.dtype == torch.float64 else x.float()
    amax = wide.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.full_like(amax, FLOAT8_MAX)).float().clamp_min(torch.finfo(torch.float32).tiny)
    return (wide / scale).to(FLOAT8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The vectors ``quantize`` kept, in ``dtype``."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (codes.to(wide) * scale.to(wide)).to(dtype)


def fake_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` as a float8 ring gives it back (the gradient passes straight through), and its codes and scales."""
    codes, scale = quantize(x.detach())
    read = dequantize(codes, scale, x.dtype)
    return (x + (read - x).detach() if x.requires_grad else read), codes, scale


@dataclass
class Float8WindowState(HybridState):
    """A window layer's ``HybridState`` with float8 codes in ``keys`` / ``values`` and their scales."""

    key_scale: torch.Tensor | None = None  # [B, Hk, <=w, 1] float32
    value_scale: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.key_features, self.values, self.linear, self.valid, self.key_scale, self.value_scale)

    def map(self, fn) -> "Float8WindowState":
        return Float8WindowState(*(fn(x) for x in self.tensors()))

    def read(self, dtype) -> HybridState:
        """The window read back: an exact layer's state."""
        return HybridState(dequantize(self.keys, self.key_scale, dtype), self.key_features,
                           dequantize(self.values, self.value_scale, dtype), self.linear, self.valid)


@dataclass
class Float8RingState(RingHybridState):
    """The fast decoder's ring (``RingHybridState``) with float8 codes and their scales, updated in place."""

    key_scale: torch.Tensor | None = None  # [B, Hk, w, 1] float32
    value_scale: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.key_features, self.values, self.linear, self.valid, self.slot, self.key_scale,
                self.value_scale)

    def map(self, fn) -> "Float8RingState":
        return Float8RingState(*(fn(x) for x in self.tensors()[:5]), slot=self.slot.clone(), sinks=self.sinks,
                               fill=None if self.fill is None else fn(self.fill), key_scale=fn(self.key_scale),
                               value_scale=fn(self.value_scale))

    @classmethod
    def from_state(cls, state: Float8WindowState, window: int, keep_key_features: bool = False,
                   copy: bool = True) -> "Float8RingState":
        """A ring of ``window`` slots holding ``state``'s window, oldest first, empty slots (codes and scales
        zero, ``valid`` False) in front; the window's (zero) key features are not kept."""
        have = state.keys.shape[2]
        if have > window:
            raise ValueError(f"the state holds {have} window tokens, more than the window ({window})")
        pad = window - have
        valid = pad_front(state.valid, 1, pad)
        keep = valid[:, None, :, None]
        keys, values = (pad_front(x.view(torch.uint8), 2, pad) * keep for x in (state.keys, state.values))
        scales = [pad_front(x, 2, pad) * keep for x in (state.key_scale, state.value_scale)]
        kf = state.key_features
        slot = torch.zeros((), dtype=torch.long, device=state.keys.device)
        linear = state.linear.clone() if copy else state.linear.contiguous()
        return cls(keys.view(FLOAT8).contiguous(), kf.new_empty((*kf.shape[:2], 0, kf.shape[3])),
                   values.view(FLOAT8).contiguous(), linear, valid.contiguous(), slot=slot,
                   key_scale=scales[0].contiguous(), value_scale=scales[1].contiguous())


def float8_window_state(state: HybridState, k8, ks, v8, vs) -> Float8WindowState:
    """``state`` (``window_state``'s, of the prompt's read-back keys and values) keeping the codes of its
    tokens instead: ``k8``/``ks``/``v8``/``vs`` are the whole prompt's codes and scales ``[B, Hk, T, .]``; padding
    tokens' codes are zeroed as the exact state zeroes their keys."""
    kept = state.keys.shape[2]
    real = state.valid[:, None, :, None]
    cut = lambda x: x[:, :, x.shape[2] - kept:]  # noqa: E731
    codes = [(cut(x).view(torch.uint8) * real).view(FLOAT8).contiguous() for x in (k8, v8)]
    scales = [(cut(x) * real).contiguous() for x in (ks, vs)]
    return Float8WindowState(codes[0], state.key_features, codes[1], state.linear, state.valid,
                             key_scale=scales[0], value_scale=scales[1])


def float8_window_step(q, k, v, state: Float8WindowState, step, **kw) -> tuple[torch.Tensor, Float8WindowState]:
    """One token: ``step`` (the exact ``window_softmax_step``) on the read-back window and the new token's
    read-back key and value; the new state keeps the codes (the window's last ``window`` tokens)."""
    k8, ks = quantize(k)
    v8, vs = quantize(v)
    o, new = step(q, dequantize(k8, ks, k.dtype), dequantize(v8, vs, v.dtype),
                  state.read(k.dtype), **kw)
    kept = new.keys.shape[2]
    real = new.valid[:, None, -1:, None]
    tail = lambda old, x: torch.cat([old, x], dim=2)[:, :, -kept:]  # noqa: E731
    codes = [tail(old.view(torch.uint8), (x.view(torch.uint8) * real)).view(FLOAT8)
             for old, x in ((state.keys, k8), (state.values, v8))]
    scales = [tail(old, x * real) for old, x in ((state.key_scale, ks), (state.value_scale, vs))]
    return o, Float8WindowState(codes[0], new.key_features, codes[1], new.linear, new.valid, key_scale=scales[0],
                                value_scale=scales[1])


def _use_float8_step_kernel(q, state: "Float8RingState") -> bool:
    """Whether ``float8_window_step_ring`` runs as the Triton kernel (decided from metadata alone: no host
    sync, so the same inside CUDA-graph capture)."""
    from . import STEP_KERNEL_DTYPES

    if not (FLOAT8_STEP_KERNEL and q.is_cuda and q.dtype in STEP_KERNEL_DTYPES):
        return False
    if not all(x.is_contiguous() for x in (state.keys, state.values, state.key_scale, state.value_scale,
                                           state.valid)):
        return False
    from ..availability import triton_available

    return triton_available()


def float8_window_step_ring(q, k, v, state: Float8RingState, ring_step, **kw) -> tuple[torch.Tensor, Float8RingState]:
    """One token on the ring, in place: the new token's codes and scales into slot ``state.slot``, then the
    softmax over the ring read back in q's dtype, the new token's read-back key and value included, which
    marks the slot valid and advances the slot counter. On CUDA one Triton launch that quantises the new token,
    writes its codes and decodes the ring's (``FLOAT8_STEP_KERNEL``); else, and the reference, ``quantize``,
    the codes copied into the slot and ``ring_step`` (the exact ``window_softmax_step_ring``) on the read-back
    ring. ``kw``: ``scale``, ``softcap`` and ``sink_q`` (``sinks.py``'s reach)."""
    if _use_float8_step_kernel(q, state):
        from .step_triton import window_step_ring_float8_triton

        o, _ = window_step_ring_float8_triton(q, k, v, state, **kw)
        return o, state
    k8, ks = quantize(k)
    v8, vs = quantize(v)
    idx = state.slot.view(1)
    for buf, x in ((state.keys, k8), (state.values, v8)):
        buf.view(torch.uint8).index_copy_(2, idx, x.view(torch.uint8))
    state.key_scale.index_copy_(2, idx, ks)
    state.value_scale.index_copy_(2, idx, vs)
    dtype = q.dtype
    k, v = dequantize(k8, ks, dtype), dequantize(v8, vs, dtype)
    read = RingHybridState(dequantize(state.keys, state.key_scale, dtype), state.key_features,
                           dequantize(state.values, state.value_scale, dtype), state.linear, state.valid,
                           slot=state.slot, sinks=state.sinks)
    o, _ = ring_step(q, k, v, read, **kw)
    return o, state
