"""Softmax over each query's last ``window`` keys and nothing else: the window of the delta hybrid
(``ops/delta/window.py``) and the sliding-window softmax layers a student may keep (``spec.softmax_window``,
``mixers/window.py``). With zero features the LoLCATs hybrid's forms compute exactly this (its linear terms
vanish and the shared normaliser is the window's alone), so the reference, the chunked form and the steps are
the hybrid's; here are the faster whole-sequence forms and their dispatcher, and the decoding state:

* ``window_softmax``: the sequence form, through the hybrid's Triton kernels with zero features
  (``WINDOW_KERNEL``, windows up to their ``KERNEL_MAX_WINDOW``), without a gradient one Triton launch on
  CUDA (``WINDOW_TRITON``, ``parallel_triton.py``) or causal flash calls on blocks (``WINDOW_FLASH``,
  ``flash.py``), SDPA on blocks (``WINDOW_SDPA``: no soft-cap) or the hybrid's chunked form with zero features;
* ``window_state``: after a prompt, its last ``window`` keys and values (a ``HybridState`` of zero features
  and an empty linear state, so every hybrid form and the fast decoder's ring take it);
* ``window_softmax_step`` (one token from a ``HybridState``) and ``window_softmax_step_ring`` (in place on a
  ``RingHybridState``: the fast decoder's, fixed shapes; on CUDA one Triton launch, ``step_triton.py``,
  ``WINDOW_STEP_KERNEL``);
* float8 rings (``float8.py``): the keys and values as e4m3 codes with a scale per token and key head (their
  ring step on CUDA: the same Triton kernel reading the codes, ``FLOAT8_STEP_KERNEL``);
* attention sinks (``sinks.py``): the window plus each sequence's first tokens, the sequence form on SDPA blocks
  with its gradient (not yet in the mixer, its states or steps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..hybrid import HybridState, RingHybridState, hybrid_attention_chunked, hybrid_attention_step
from ..hybrid.shared import _real_keys, _scores
from ..linear_attention import _group, accum_dtype
from . import flash


# The window softmax through SDPA on blocks (no soft-cap: linear in the length, fused kernels with their own
# backward on CUDA; on the CPU too, where the chunked form with zero features took 4.8 s for 128 tokens in a
# 2,048-token window against SDPA's 1 ms, and twice SDPA's time at 64), else the hybrid's chunked form.
# "auto" and True: so; False: never (tests).
WINDOW_SDPA: str | bool = "auto"


def _use_window_sdpa(q, softcap) -> bool:
    return bool(WINDOW_SDPA) and softcap is None


# The window's softmax through the LoLCATs hybrid's Triton kernels (``ops/hybrid/chunk_triton.py``) with zero
# features, so that nothing is linear: one fused forward and backward, soft-capping and padding included, the
# cost of the default student's window. False: not (SDPA on blocks or the chunked form, as above); True: wherever
# ``use_hybrid_kernel`` allows (CUDA, half precision, windows up to its KERNEL_MAX_WINDOW).
WINDOW_KERNEL: bool = False
ZERO_FEATURES = 16  # the kernels' narrowest feature tile


def _use_window_kernel(q, k, v, window: int) -> bool:
    """Under autocast, as the hybrid decides: fp32 inputs (RoPE's) go in as the autocast dtype."""
    from ..hybrid import kernel_dtype, use_hybrid_kernel

    return WINDOW_KERNEL and use_hybrid_kernel(q, "auto", window=window, head_dim=q.shape[-1],
                                                feature_width=ZERO_FEATURES, dtype=kernel_dtype(q, k, v))


def window_softmax_kernel(q, k, v, *, window: int, scale: float, softcap: float | None = None, key_mask=None):
    """Softmax over each query's last ``window`` keys through the hybrid's Triton kernels, whose linear
    terms vanish with zero features (the shared normaliser is then the window's alone). ``[B, H, T, D]``."""
    from ..hybrid import kernel_dtype
    from ..hybrid.chunk_triton import hybrid_triton

    dtype = kernel_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    zq, zk = q.new_zeros(*q.shape[:3], ZERO_FEATURES), k.new_zeros(*k.shape[:3], ZERO_FEATURES)
    gamma = torch.ones(q.shape[1], device=q.device, dtype=torch.float32)
    o, _ = hybrid_triton(q, k, v, gamma, qf=zq, kf=zk, window=window, scale=scale, softcap=softcap, key_mask=key_mask)
    return o


# Without a gradient (prefill, evaluation), on CUDA, the window softmax as one Triton launch
# (``parallel_triton.py``: grouped heads, strides, padding and soft-capping read as they come). False: never.
WINDOW_TRITON: bool = True


def _use_window_triton(q, k, v, window: int) -> bool:
    if not WINDOW_TRITON:
        return False
    from . import parallel_triton

    return parallel_triton.supported(q, k, v, window)


# Without a gradient (prefill, evaluation), windows of at least ``flash.MIN_WINDOW`` tokens go through
# ``flash.py``: mask-free causal flash calls on blocks of ``window - 1`` tokens, merged by their log-sum-exp,
# where the masked band of ``window_softmax_sdpa`` sends SDPA to slower kernels over twice the keys. False: never.
WINDOW_FLASH: bool = True


def _window_block(window: int) -> int:
    """Query block of the blocked window softmax: at least ``window - 1`` (a block's keys are its own
    and the previous block's), a multiple of 16 for the kernels' tiles."""
    return max(16, -(-max(window - 1, 1) // 16) * 16)


def window_softmax_sdpa(q, k, v, *, window: int, scale: float, key_mask=None):
    """Softmax over each query's last ``window`` keys (itself included), padding keys left out, as
    ``scaled_dot_product_attention`` on blocks: the queries cut into blocks of ``C >= window - 1``
    tokens, each block attending to its own and the previous block's keys under a band mask, so the
    cost is ``T x 2C``, not ``T^2``. ``[B, H, T, D]`` in ``q``'s dtype. A padding query attends to
    itself alone (no row is empty); the hybrid zeroes its output. A sequence no longer than the window
    without padding is plain causal attention: one SDPA call without a mask, which its flash kernel takes
    (keys and values repeated to the query heads: its fused kernels refuse grouped heads)."""
    b, h, t, d = q.shape
    n_kv = k.shape[1]
    if key_mask is None and t <= window:
        grp = h // n_kv
        k, v = (x.to(q.dtype).repeat_interleave(grp, dim=1) if grp > 1 else x.to(q.dtype) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    c = _window_block(window)
    n = -(-t // c)
    pad = n * c - t
    k, v = k.to(q.dtype), v.to(q.dtype)
    blocks = lambda x: F.pad(x, (0, 0, 0, pad)).unflatten(2, (n, c)).transpose(1, 2)  # noqa: E731  [B, N, H, C, D]
    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    before = lambda x: F.pad(x, (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1]  # noqa: E731  the previous block (zeros first)
    kb, vb = torch.cat([before(kb), kb], dim=3), torch.cat([before(vb), vb], dim=3)  # [B, N, Hk, 2C, D]
    pos = torch.arange(n * c, device=q.device).view(n, c)
    key_pos = torch.cat([pos - c, pos], dim=1)  # [N, 2C]
    dist = pos[:, :, None] - key_pos[:, None, :]  # [N, C, 2C]
    allowed = (dist >= 0) & (dist < window) & (key_pos >= 0)[:, None, :]
    if key_mask is not None:
        real = F.pad(key_mask.bool(), (c, pad))  # [B, C + N C]: position p at p + C
        allowed = allowed & real[:, key_pos + c][:, :, None, :] | (dist == 0)  # [B, N, C, 2C]
    else:
        allowed = allowed | (dist == 0)
    allowed = allowed.expand(b, n, c, 2 * c).reshape(b * n, 1, c, 2 * c)
    o = F.scaled_dot_product_attention(qb.reshape(b * n, h, c, d), kb.reshape(b * n, n_kv, 2 * c, d),
                                       vb.reshape(b * n, n_kv, 2 * c, v.shape[-1]), attn_mask=allowed, scale=scale,
                                       enable_gqa=n_kv != h)
    return o.view(b, n, h, c, -1).transpose(1, 2).flatten(2, 3)[:, :, :t]


def _window_softmax_inputs(q, k):
    """Zero features for the hybrid ops: with nothing linear they are the window's softmax alone."""
    return q.new_zeros(*q.shape[:3], 1), k.new_zeros(*k.shape[:3], 1)


def zero_features(q, k, width: int = 1):
    """Zero features for the hybrid's forms: with nothing linear they are the window's softmax alone."""
    return q.new_zeros(*q.shape[:3], width), k.new_zeros(*k.shape[:3], width)


def window_softmax(q, k, v, *, window: int, scale: float, softcap: float | None = None, key_mask=None):
    """Softmax over each query's last ``window`` keys (itself included; padding keys left out), ``[B, H, T, D]``:
    through the hybrid's kernels where ``WINDOW_KERNEL`` takes it, without a gradient one Triton launch
    (``WINDOW_TRITON``, CUDA) or flash calls on blocks (``WINDOW_FLASH``), SDPA on blocks (no soft-cap), else the
    hybrid's chunked form with zero features (fp32 accumulation; the output in the computing dtype). Padding
    queries output zero."""
    if _use_window_kernel(q, k, v, window):
        return window_softmax_kernel(q, k, v, window=window, scale=scale, softcap=softcap, key_mask=key_mask)
    if _use_window_triton(q, k, v, window):
        from .parallel_triton import window_softmax_triton

        return window_softmax_triton(q, k, v, window=window, scale=scale, softcap=softcap, key_mask=key_mask)
    if WINDOW_FLASH and flash.supported(q, k, v, window, softcap, key_mask):
        try:
            return flash.window_softmax_flash(q, k, v, window=window, scale=scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:  # a GPU or build whose flash kernels refuse these inputs: SDPA blocks from now on
            flash.refused(err)
    if _use_window_sdpa(q, softcap):
        o = window_softmax_sdpa(q, k, v, window=window, scale=scale, key_mask=key_mask)
        return o if key_mask is None else o * key_mask[:, None, :, None]  # padding queries: 0, as the forms below
    ones = torch.ones(q.shape[1], dtype=accum_dtype(q.dtype), device=q.device)
    o, _ = hybrid_attention_chunked(q, k, *zero_features(q, k), v, ones, window=window, scale=scale, softcap=softcap,
                                    key_mask=key_mask)
    return o


def window_state(k, v, window: int, key_mask=None) -> HybridState:
    """The decoding state after a prompt of keys ``k`` (rotated) and values ``v`` ``[B, Hk, T, D]``: its last
    ``window`` tokens (padding zeroed and marked), zero features, an empty linear state."""
    b, n_kv, t, d = k.shape
    cut = max(t - window, 0)
    tail = key_mask[:, cut:] if key_mask is not None else None
    valid = tail if tail is not None else torch.ones(b, t - cut, dtype=torch.bool, device=k.device)
    keys, values = _real_keys(tail, k[:, :, cut:], v[:, :, cut:])
    linear = torch.zeros(b, n_kv, 1, 1, v.shape[-1] + 1, dtype=accum_dtype(k.dtype), device=k.device)
    return HybridState(keys.contiguous(), k.new_zeros(b, n_kv, t - cut, 1), values.contiguous(), linear,
                       valid.contiguous())


def window_softmax_step(q, k, v, state: HybridState, *, window: int, scale: float, softcap=None, key_mask=None):
    """One token (``T = 1``) from ``state`` (``window_state``'s): ``(o [B, H, 1, D], new_state)``."""
    ones = torch.ones(q.shape[1], dtype=state.linear.dtype, device=q.device)
    return hybrid_attention_step(q, k, *zero_features(q, k), v, ones, state, window=window, scale=scale,
                                 softcap=softcap, key_mask=key_mask)


# The ring step as one Triton launch (``step_triton.py``) where ``_use_window_step_kernel`` allows: on CUDA
# with Triton, q and the ring in bf16, fp16 or fp32, the ring's buffers contiguous. False: always the
# PyTorch step below (the reference, and the CPU's path).
WINDOW_STEP_KERNEL: bool = True
STEP_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _use_window_step_kernel(q, state: RingHybridState) -> bool:
    """Whether ``window_softmax_step_ring`` runs as the Triton kernel (decided from metadata alone: no
    host sync, so the same inside CUDA-graph capture)."""
    if not (WINDOW_STEP_KERNEL and q.is_cuda and q.dtype in STEP_KERNEL_DTYPES):
        return False
    if state.keys.dtype not in STEP_KERNEL_DTYPES or state.values.dtype not in STEP_KERNEL_DTYPES:
        return False  # e.g. float8 rings (float8_window_step_ring takes them to the kernel)
    if not (state.keys.is_contiguous() and state.values.is_contiguous() and state.valid.is_contiguous()):
        return False
    from ..availability import triton_available

    return triton_available()


def window_softmax_step_ring(q, k, v, state: RingHybridState, *, scale: float, softcap=None, sink_q=None):
    """One token on the fast decoder's ring (every decoded token real), in place with fixed shapes: the new
    token overwrites slot ``state.slot`` (the oldest), then the softmax over the ring's valid slots (its
    ``state.sinks`` sink slots scored by ``sink_q`` where given, ``sinks.py``'s reach).
    Returns ``(o [B, H, 1, D], state)``. On CUDA one Triton launch (``WINDOW_STEP_KERNEL``,
    ``step_triton.window_step_ring_triton``); the PyTorch code below is its reference."""
    if _use_window_step_kernel(q, state):
        from .step_triton import window_step_ring_triton

        return window_step_ring_triton(q, k, v, state, scale=scale, softcap=softcap, sink_q=sink_q)
    idx = state.slot.view(1)
    state.keys.index_copy_(2, idx, k.to(state.keys.dtype))
    state.values.index_copy_(2, idx, v.to(state.values.dtype))
    state.valid.index_fill_(1, idx, True)
    state.advance()
    if sink_q is not None and state.sinks:
        return attend_slots(q, state.keys, state.values, state.valid, scale, softcap, sink_q, state.sinks), state
    if softcap is None:
        # one SDPA call, a group's query heads as its query rows: the ring is read in its own dtype (a wide
        # window is not copied to fp32 each step), scores and softmax in fp32 inside the kernel
        b, h = q.shape[:2]
        qg = q.reshape(b, k.shape[1], h // k.shape[1], q.shape[-1]).to(state.keys.dtype)  # [B, Hk, G, D]
        o = F.scaled_dot_product_attention(qg, state.keys, state.values, attn_mask=state.valid[:, None, None, :],
                                           scale=scale)
        return o.reshape(b, h, 1, -1).to(q.dtype), state
    return attend_slots(q, state.keys, state.values, state.valid, scale, softcap), state


def attend_slots(q, keys, values, valid, scale: float, softcap=None, sink_q=None, sinks: int = 0):
    """One query token ``[B, H, 1, D]`` over ``keys``/``values`` ``[B, Hk, N, D]`` where ``valid`` ``[B, N]``: scores
    (soft-capped or not) and softmax in fp32, the output in q's dtype. ``sink_q`` (like ``q``): the query that
    scores the first ``sinks`` slots instead (``sinks.py``'s reach)."""
    acc = accum_dtype(q.dtype)
    qg = _group(q, keys.shape[1]).to(acc)  # [B, Hk, G, 1, D]
    scores = _scores(qg, keys.to(acc).unsqueeze(2), scale, softcap)
    if sink_q is not None and sinks:
        lead = _scores(_group(sink_q, keys.shape[1]).to(acc), keys[:, :, :sinks].to(acc).unsqueeze(2), scale, softcap)
        scores = torch.cat([lead, scores[..., sinks:]], dim=-1)
    scores = scores.masked_fill(~valid[:, None, None, None, :], torch.finfo(acc).min)
    o = torch.softmax(scores, dim=-1) @ values.to(acc).unsqueeze(2)
    return o.flatten(1, 2).to(q.dtype)
