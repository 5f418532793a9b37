"""The sliding-window + gated delta-rule hybrid (``kind: delta``; the rule itself: ``rule.py``).

``delta_window_*``: softmax over the last ``w`` tokens as in LoLCATs, and the
delta-rule memory over older tokens only: token s is written when it leaves the window, at time
``s + w`` (its own gates with it). The two are combined convexly,

    y_t = (1 - m_t) softmax_window(t) + m_t S_t^T q_t,     m_t = lambda_t [some real token is older than the window]

Why this form: the teacher's full softmax splits exactly into the window's softmax average and
the older tokens' softmax average, weighted by the attention mass ``alpha_t`` on older tokens:
``y*_t = (1 - alpha_t) ybar^win_t + alpha_t ybar^old_t``. The delta memory is a regression memory
that returns a value (not an unnormalised sum with a mass, as a positive linear attention would),
so it stands in for ``ybar^old`` and the learned, data-dependent ``lambda_t`` (a sigmoid) for
``alpha_t``; the indicator makes ``alpha_t = 0`` exact while nothing has left the window, so a
window covering the sequence is exactly the teacher's softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..hybrid import (
    HybridState, empty_hybrid_state, hybrid_attention_naive,
)
from ..hybrid.shared import _real_keys, _scores
from ..linear_attention import _group, accum_dtype
from ..window import window_softmax, window_softmax_step, zero_features
from .rule import _readout, _write, empty_delta_state, gated_delta_rule
from .state import DeltaWindowState, RingDeltaState, empty_delta_window_state


# --- the hybrid: window softmax + the delta memory of older tokens ------------------------------------

def _masked_gates(g, beta, key_mask):
    """Padding tokens neither decay nor write."""
    if key_mask is None:
        return g, beta
    keep = key_mask[:, None, :]
    return g * keep, beta * keep


def _combine(o_win, o_mem, lam, older):
    """``(1 - m) o_win + m o_mem`` with ``m = lam * older`` (``lam`` ``[B, H, T]``, ``older`` ``[B, T]`` bool)."""
    m = (lam.to(o_mem.dtype) * older[:, None, :])[..., None]
    return o_win.to(o_mem.dtype) * (1 - m) + o_mem * m


def _combine_sequence(o_win, o_mem, lam, older, key_mask, dtype):
    """``_combine`` for a whole sequence in one pass at the outputs' precision (bf16 on the GPU, not four passes
    in fp32): ``lerp`` computes in fp32 and rounds once, as the fp32 form rounds its result once; only the
    weight ``m`` is rounded to that precision first. Padding queries are zeroed only where there is padding."""
    common = torch.promote_types(o_win.dtype, o_mem.dtype)
    m = (lam * older[:, None, :]).to(common)[..., None]
    y = torch.lerp(o_win.to(common), o_mem.to(common), m)
    if key_mask is not None:
        y = y * key_mask[:, None, :, None]
    return y.to(dtype)


def delta_window_naive(q, k, qd, kd, v, g, beta, lam, *, window: int, scale: float, softcap: float | None = None,
                       key_mask: torch.Tensor | None = None):
    """The reference: the window's softmax (quadratic) and the delta memory written token by token
    as tokens leave the window. ``q``/``qd`` ``[B, H, T, *]`` (raw after RoPE / delta features),
    ``k``/``kd``/``v`` ``[B, Hk, T, *]``, ``g``/``beta`` ``[B, Hk, T]``, ``lam`` ``[B, H, T]`` in [0, 1].
    Padding queries output zero. Returns ``[B, H, T, D]``."""
    acc = accum_dtype(q.dtype)
    b, n_kv, t, _ = k.shape
    real = key_mask if key_mask is not None else torch.ones(b, t, dtype=torch.bool, device=q.device)
    ones = torch.ones(q.shape[1], dtype=acc, device=q.device)
    o_win = hybrid_attention_naive(q, k, *zero_features(q, k), v, ones, window=window, scale=scale,
                                   softcap=softcap, key_mask=key_mask).to(acc)
    g, beta = _masked_gates(g.to(acc), beta.to(acc), key_mask)
    state = empty_delta_state(b, n_kv, kd.shape[-1], v.shape[-1], device=q.device, dtype=acc)
    written = torch.zeros(b, dtype=torch.bool, device=q.device)
    outs, olds = [], []
    for i in range(t):
        s = i - window
        if s >= 0:  # token s leaves the window and is written
            state = _write(state, kd[:, :, s], v[:, :, s], g[:, :, s], beta[:, :, s])
            written = written | real[:, s]
        outs.append(_readout(qd[:, :, i : i + 1], state))
        olds.append(written)
    y = _combine(o_win, torch.cat(outs, dim=2), lam.to(acc), torch.stack(olds, dim=1))
    return (y * real[:, None, :, None]).to(q.dtype)


def delta_window_chunked(q, k, qd, kd, v, g, beta, lam, *, window: int, scale: float, softcap=None,
                         key_mask=None, output_final_state: bool = False, chunk_size: int = 64,
                         backend: str = "torch"):
    """The sequence form: the window's softmax through ``ops.window.window_softmax`` (SDPA on blocks),
    the memory through ``gated_delta_rule`` (fla or chunked) on the keys, values and gates delayed by
    ``w`` tokens. Returns ``(y [B, H, T, D], DeltaWindowState or None)``."""
    acc = accum_dtype(q.dtype)
    b, n_kv, t, _ = k.shape
    real = key_mask if key_mask is not None else torch.ones(b, t, dtype=torch.bool, device=q.device)
    o_win = window_softmax(q, k, v, window=window, scale=scale, softcap=softcap, key_mask=key_mask)
    gm, bm = _masked_gates(g, beta, key_mask)
    w = min(window, t)
    late = lambda x: F.pad(x[..., : t - w, :], (0, 0, w, 0))  # noqa: E731  token s at time s + w
    late_gate = lambda x: F.pad(x[..., : t - w], (w, 0))  # noqa: E731
    o_mem, memory = gated_delta_rule(qd, late(kd), late(v), late_gate(gm), late_gate(bm), chunk_size=chunk_size,
                                     output_final_state=output_final_state, backend=backend)
    older = F.pad(real[:, : t - w], (w, 0)).cumsum(1) > 0
    y = _combine_sequence(o_win, o_mem, lam, older, key_mask, q.dtype)
    if not output_final_state:
        return y, None
    cut = max(t - window, 0)  # the window's last tokens, raw (padding zeroed); older ones are in the memory
    valid = key_mask[:, cut:] if key_mask is not None else torch.ones(b, t - cut, dtype=torch.bool, device=q.device)
    kd_tail, v_tail = _real_keys(valid if key_mask is not None else None, kd[:, :, cut:], v[:, :, cut:])
    state = DeltaWindowState(k[:, :, cut:], v_tail, kd_tail, gm[..., cut:].to(acc), bm[..., cut:].to(acc), valid,
                             memory.to(acc), older[:, -1])
    return y, state


def delta_window_step(q, k, qd, kd, v, g, beta, lam, state: DeltaWindowState, *, window: int, scale: float,
                      softcap=None, key_mask=None):
    """One token (``T = 1``). Returns ``(y [B, H, 1, D], new_state)``."""
    acc = state.memory.dtype
    b = k.shape[0]
    real = key_mask if key_mask is not None else torch.ones(b, 1, dtype=torch.bool, device=k.device)
    g, beta = _masked_gates(g.to(acc), beta.to(acc), real)
    window_part = HybridState(state.keys, state.keys.new_zeros(*state.keys.shape[:3], 1), state.values,
                              empty_hybrid_state(b, k.shape[1], k.shape[-1], 1, device=k.device,
                                                 dtype=k.dtype).linear, state.valid)
    o_win, after = window_softmax_step(q, k, v, window_part, window=window, scale=scale, softcap=softcap,
                                       key_mask=real)
    delta_keys = torch.cat([state.delta_keys, kd.to(state.delta_keys.dtype)], dim=2)
    gates, betas = torch.cat([state.gates, g], dim=2), torch.cat([state.betas, beta], dim=2)
    memory, written = state.memory, state.written
    if delta_keys.shape[2] > window:  # the oldest token leaves the window: write it
        memory = _write(memory, delta_keys[:, :, 0], state.values[:, :, 0], gates[:, :, 0], betas[:, :, 0])
        written = written | state.valid[:, 0]
        delta_keys, gates, betas = delta_keys[:, :, 1:], gates[:, :, 1:], betas[:, :, 1:]
    y = _combine(o_win.to(acc), _readout(qd, memory), lam.to(acc), written[:, None])
    y = (y * real[:, None, :, None]).to(q.dtype)
    return y, DeltaWindowState(after.keys, after.values, delta_keys, gates, betas, after.valid, memory, written)


def delta_window_recurrent(q, k, qd, kd, v, g, beta, lam, *, window, scale, softcap=None, initial_state=None,
                           key_mask=None):
    """Token by token through ``delta_window_step`` (the decoding form)."""
    b, h, t, d = q.shape
    state = initial_state or empty_delta_window_state(b, k.shape[1], d, kd.shape[-1], device=q.device, dtype=k.dtype)
    outs = []
    for i in range(t):
        sl = slice(i, i + 1)
        o, state = delta_window_step(q[:, :, sl], k[:, :, sl], qd[:, :, sl], kd[:, :, sl], v[:, :, sl],
                                     g[:, :, sl], beta[:, :, sl], lam[:, :, sl], state, window=window, scale=scale,
                                     softcap=softcap, key_mask=None if key_mask is None else key_mask[:, sl])
        outs.append(o)
    return torch.cat(outs, dim=2), state


def delta_window_step_ring(q, k, qd, kd, v, g, beta, lam, state: RingDeltaState, *, scale: float, softcap=None):
    """``delta_window_step`` on a ring state, in place and with fixed shapes (every decoded token is
    real): the token in slot ``state.slot`` is written to the memory (an empty slot changes nothing),
    the new token takes its place, then the window's softmax and the memory are read and mixed.
    Returns ``(y [B, H, 1, D], state)``."""
    acc = state.memory.dtype
    n_kv = k.shape[1]
    idx = state.slot.view(1)
    take = lambda x: x.index_select(2, idx)[:, :, 0]  # noqa: E731
    state.memory.copy_(_write(state.memory, take(state.delta_keys), take(state.values), take(state.gates),
                              take(state.betas)))
    state.written.logical_or_(state.valid.index_select(1, idx)[:, 0])
    for buf, new in ((state.keys, k), (state.values, v), (state.delta_keys, kd)):
        buf.index_copy_(2, idx, new.to(buf.dtype))
    state.gates.index_copy_(2, idx, g.to(acc))
    state.betas.index_copy_(2, idx, beta.to(acc))
    state.valid.index_fill_(1, idx, True)
    state.slot.add_(1).remainder_(state.keys.shape[2])
    qg = _group(q, n_kv).to(acc)  # [B, Hk, G, 1, D]
    scores = _scores(qg, state.keys.to(acc).unsqueeze(2), scale, softcap)  # in the autocast dtype under autocast
    scores = scores.masked_fill(~state.valid[:, None, None, None, :], torch.finfo(scores.dtype).min)
    o_win = (torch.softmax(scores, dim=-1) @ state.values.to(acc).unsqueeze(2)).flatten(1, 2)
    y = _combine(o_win, _readout(qd, state.memory), lam.to(acc), state.written[:, None])
    return y.to(q.dtype), state
