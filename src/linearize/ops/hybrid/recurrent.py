"""The LoLCATs hybrid one token at a time (``ops/hybrid/__init__.py`` has the math): the decoding
forms. ``hybrid_attention_step`` and ``sparse_hybrid_attention_step`` update their state
(``HybridState``, ``SparseHybridState``) out of place, the window growing to ``w`` tokens;
``*_step_ring`` do the same on a ring window in place with fixed shapes (``RingHybridState``,
``RingSparseState``: the fast decoder's, CUDA-graph friendly; the fused Triton steps are
``step_triton.py``); ``*_recurrent`` run a sequence token by token through the step (the reference
for decoding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear_attention import _augment, _group
from .shared import _mix_shape, _mixed, _real_keys, _scores
from .sparse_select import _check, _lowest, _rescored
from .state import (HybridState, RingHybridState, RingSparseState, SparseHybridState, _leaving, empty_hybrid_state,
                    empty_sparse_hybrid_state)


def _faded(linear: torch.Tensor, log_gate: torch.Tensor | None) -> torch.Tensor:
    """The linear state ``[B, Hk, 1, F, D + 1]`` times this step's gate (``log_gate`` ``[B, Hk, 1]``)."""
    if log_gate is None:
        return linear
    return linear * log_gate.to(linear.dtype).exp()[..., None, None]


def hybrid_attention_step(
    q, k, qf, kf, v, gamma, state: HybridState, *, window: int, scale: float, softcap: float | None = None,
    key_mask: torch.Tensor | None = None, log_gate: torch.Tensor | None = None, mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, HybridState]:
    """One token (``T = 1`` in every input; ``key_mask`` [B, 1]; ``log_gate`` [B, Hk, 1]). Returns
    ``(y [B, H, 1, D], new_state)``."""
    acc = state.linear.dtype
    n_kv = k.shape[1]
    b = k.shape[0]
    real = key_mask if key_mask is not None else torch.ones(b, 1, dtype=torch.bool, device=k.device)
    kf, v = _real_keys(real, kf, v)
    keys = torch.cat([state.keys, k.to(state.keys.dtype)], dim=2)
    feats = torch.cat([state.key_features, kf.to(state.key_features.dtype)], dim=2)
    values = torch.cat([state.values, v.to(state.values.dtype)], dim=2)
    valid = torch.cat([state.valid, real], dim=1)
    linear = _faded(state.linear, log_gate)
    if keys.shape[2] > window:  # the oldest token leaves the window and joins the linear state
        old_f, old_v = feats[:, :, :1].to(acc), _augment(values[:, :, :1].to(acc), True)
        linear = linear + (old_f.transpose(-1, -2) @ old_v).unsqueeze(2)
        keys, feats, values, valid = keys[:, :, 1:], feats[:, :, 1:], values[:, :, 1:], valid[:, 1:]
    qg, qfg = _group(q, n_kv).to(acc), _group(qf, n_kv).to(acc)
    g = gamma.to(acc).reshape(n_kv, -1)[..., None, None]
    mask = valid[:, None, None, None, :]
    scores = _scores(qg, keys.to(acc).unsqueeze(2), scale, softcap)  # in the autocast dtype under autocast
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    c = scores.amax(dim=-1, keepdim=True)
    a = g * torch.exp(scores - c) * mask
    y = _step_output(a @ _augment(values.to(acc), True).unsqueeze(2), qfg @ linear, mix, n_kv)
    b, hk, grp, _, d = y.shape
    return y.reshape(b, hk * grp, 1, d).to(q.dtype), HybridState(keys, feats, values, linear, valid)


def _step_output(window_out, linear_out, mix, n_kv):
    """A step's ``[B, Hk, G, 1, D]`` output from its window and linear sums (``_mixed``; the shared
    denominator is at least the window's own token)."""
    if mix is None:
        out = window_out + linear_out
        return out[..., :-1] / out[..., -1:].clamp_min(torch.finfo(out.dtype).tiny)
    return _mixed(window_out, linear_out, _mix_shape(mix, n_kv, 2, window_out.dtype))


def hybrid_attention_step_ring(
    q, k, qf, kf, v, gamma, state: RingHybridState, *, scale: float, softcap: float | None = None,
    key_feature_map=None, log_gate: torch.Tensor | None = None, mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RingHybridState]:
    """``hybrid_attention_step`` on a ring state, in place and with fixed shapes (no padding: every
    decoded token is real). The evicted slot's features and values join the linear state (an empty
    slot adds zero), the new token takes its place. ``key_feature_map`` recomputes the evicted
    key's features when the state keeps none (``kf`` may then be None). Returns ``(y [B, H, 1, D], state)``."""
    acc = state.linear.dtype
    n_kv = k.shape[1]
    idx = state.slot.view(1)
    stored = state.key_features.shape[2] > 0
    if log_gate is not None:
        state.linear.mul_(log_gate.to(acc).exp()[..., None, None])
    state.linear.add_(_leaving(state, key_feature_map))
    state.keys.index_copy_(2, idx, k.to(state.keys.dtype))
    if stored:
        state.key_features.index_copy_(2, idx, kf.to(state.key_features.dtype))
    state.values.index_copy_(2, idx, v.to(state.values.dtype))
    state.valid.index_fill_(1, idx, True)
    state.slot.add_(1).remainder_(state.keys.shape[2])
    qg, qfg = _group(q, n_kv).to(acc), _group(qf, n_kv).to(acc)
    g = gamma.to(acc).reshape(n_kv, -1)[..., None, None]
    mask = state.valid[:, None, None, None, :]
    scores = _scores(qg, state.keys.to(acc).unsqueeze(2), scale, softcap)  # in the autocast dtype under autocast
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    c = scores.amax(dim=-1, keepdim=True)
    a = g * torch.exp(scores - c) * mask
    y = _step_output(a @ _augment(state.values.to(acc), True).unsqueeze(2), qfg @ state.linear, mix, n_kv)
    b, hk, grp, _, d = y.shape
    return y.reshape(b, hk * grp, 1, d).to(q.dtype), state


def hybrid_attention_recurrent(q, k, qf, kf, v, gamma, *, window, scale, softcap=None, initial_state=None,
                               key_mask=None, log_gate=None, mix=None):
    """Token by token through ``hybrid_attention_step`` (reference for the decoding form)."""
    b, h, t, d = q.shape
    state = initial_state or empty_hybrid_state(b, k.shape[1], d, kf.shape[-1], device=q.device, dtype=k.dtype)
    outs = []
    for i in range(t):
        sl = slice(i, i + 1)
        o, state = hybrid_attention_step(
            q[:, :, sl], k[:, :, sl], qf[:, :, sl], kf[:, :, sl], v[:, :, sl], gamma, state,
            window=window, scale=scale, softcap=softcap, key_mask=None if key_mask is None else key_mask[:, sl],
            log_gate=None if log_gate is None else log_gate[..., sl], mix=mix,
        )
        outs.append(o)
    return torch.cat(outs, dim=2), state


def _read_one(q, qf, gamma, keys, values, valid, cache_keys, cache_values, cache_valid, linear, real, scale, softcap,
              anchor="joint"):
    """One query token's output ``[B, H, 1, D]`` over the window (``valid`` [B, w]), the cache
    (``cache_valid`` [B, Hk, S]) and the linear state, under one normaliser; padding queries give 0."""
    acc = linear.dtype
    n_kv = keys.shape[1]
    qg, qfg = _group(q, n_kv).to(acc), _group(qf, n_kv).to(acc)
    g = gamma.to(acc).reshape(n_kv, -1)[..., None, None]
    wmask = valid[:, None, None, None, :]
    cmask = cache_valid[:, :, None, None, :]
    sw = _scores(qg, keys.to(acc).unsqueeze(2), scale, softcap)
    neg = torch.finfo(sw.dtype).min
    sw = sw.masked_fill(~wmask, neg)
    sc = _scores(qg, cache_keys.to(acc).unsqueeze(2), scale, softcap).masked_fill(~cmask, neg)
    c = torch.cat([sw, sc], dim=-1).amax(dim=-1, keepdim=True)
    read = qfg @ linear
    if anchor == "window":
        read = read * torch.exp(sw.amax(dim=-1, keepdim=True) - c)
    out = (g * torch.exp(sw - c) * wmask) @ _augment(values.to(acc), True).unsqueeze(2)
    out = out + (g * torch.exp(sc - c) * cmask) @ _augment(cache_values.to(acc), True).unsqueeze(2) + read
    y = out[..., :-1] / out[..., -1:].clamp_min(torch.finfo(acc).tiny)
    y = y * real[:, None, None, None, None]
    bb, hk, grp, _, d = y.shape
    return y.reshape(bb, hk * grp, 1, d).to(q.dtype)


def sparse_hybrid_attention_step(
    q, k, qf, kf, v, gamma, state: SparseHybridState, *, window: int, scale: float,
    softcap: float | None = None, key_mask: torch.Tensor | None = None, priority: str = "recall",
    anchor: str = "joint", log_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SparseHybridState]:
    """One token (``T = 1``; ``key_mask`` [B, 1]; ``log_gate`` [B, Hk, 1]). Returns ``(y [B, H, 1, D],
    new_state)``; the state is updated out of place. The cache size is the state's."""
    _check(priority, anchor)
    acc = state.linear.dtype
    b, n_kv = k.shape[:2]
    cap = state.cache_keys.shape[2]
    real = key_mask[:, 0] if key_mask is not None else torch.ones(b, dtype=torch.bool, device=k.device)
    kf, v = _real_keys(real[:, None], kf, v)
    started = (state.count > 0) | real
    rel = state.count
    boundary = started & (rel >= window) & (rel % window == 0)
    window_scores, cache_scores = state.window_scores, state.cache_scores
    if bool(boundary.any()):  # rescore the cache and the window (this epoch's leavers)
        lin = state.linear.squeeze(2)
        sel = boundary[:, None, None]
        new_w, new_c = _rescored(priority, state, state.valid, lin)
        window_scores = torch.where(sel, new_w, window_scores)
        cache_scores = torch.where(sel, new_c, cache_scores)
    keys = torch.cat([state.keys, k.to(state.keys.dtype)], dim=2)
    feats = torch.cat([state.key_features, kf.to(state.key_features.dtype)], dim=2)
    values = torch.cat([state.values, v.to(state.values.dtype)], dim=2)
    valid = torch.cat([state.valid, real[:, None]], dim=1)
    window_scores = torch.cat([window_scores, window_scores.new_zeros(b, n_kv, 1)], dim=2)
    linear, fade = state.linear, state.cache_fade
    if log_gate is not None:  # this step's gate fades the linear state and every cached token's pending fade
        lg = log_gate.to(acc)
        linear = linear * lg.exp()[..., None, None]
        fade = (fade if fade is not None else torch.zeros_like(state.cache_scores, dtype=acc)) + lg
    ck, cf, cv = state.cache_keys, state.cache_features, state.cache_values
    cvalid, cpos = state.cache_valid, state.cache_pos
    if keys.shape[2] > window:  # the oldest token leaves the window: into the cache, maybe pushing one out
        lk, lf, lv = keys[:, :, :1], feats[:, :, :1], values[:, :, :1]
        l_valid = valid[:, None, :1].expand(b, n_kv, 1)
        l_pos = (rel - window)[:, None, None].expand(b, n_kv, 1)
        cand_valid = torch.cat([cvalid, l_valid], dim=2)
        cand_pri = torch.cat([cache_scores, window_scores[:, :, :1]], dim=2)
        cand_pos = torch.cat([cpos, l_pos], dim=2)
        full = cand_valid.sum(-1) > cap  # [B, Hk]: one candidate must go
        victim = _lowest(cand_pri, cand_pos, cand_valid)  # in 0..S (S: the newcomer itself)
        empty = (~cvalid).long().argmax(-1) if cap else victim  # first free slot (if not full, one exists)
        slot = torch.where(full, victim, empty)
        write = l_valid[..., 0] & (slot < cap)
        # fold the victim into the linear state (under gates with the fade it gathered in the cache)
        pick = F.one_hot(victim, cap + 1).to(acc) * full[..., None]  # [B, Hk, S + 1]
        weight = pick if fade is None else pick * torch.cat([fade, fade.new_zeros(b, n_kv, 1)], dim=2).exp()
        gone_f = (weight[..., None] * torch.cat([cf, lf], dim=2).to(acc)).sum(2, keepdim=True)  # [B, Hk, 1, F]
        gone_v = (pick[..., None] * torch.cat([cv, lv], dim=2).to(acc)).sum(2, keepdim=True)
        linear = linear + (gone_f.transpose(-1, -2) @ _augment(gone_v, True)).unsqueeze(2)
        # the newcomer takes the victim's (or a free) slot
        put = (torch.arange(cap, device=k.device) == slot[..., None]) & write[..., None]  # [B, Hk, S]
        ck, cf, cv = (torch.where(put[..., None], x_new, x) for x, x_new in ((ck, lk), (cf, lf), (cv, lv)))
        cache_scores = torch.where(put, window_scores[:, :, :1], cache_scores)
        cpos = torch.where(put, l_pos, cpos)
        cvalid = cvalid | put
        if fade is not None:  # the newcomer's fade starts now
            fade = fade.masked_fill(put, 0)
        keys, feats, values, valid = keys[:, :, 1:], feats[:, :, 1:], values[:, :, 1:], valid[:, 1:]
        window_scores = window_scores[:, :, 1:]
    y = _read_one(q, qf, gamma, keys, values, valid, ck, cv, cvalid, linear, real, scale, softcap, anchor)
    new = SparseHybridState(keys, feats, values, valid, window_scores, linear, ck, cf, cv, cvalid, cache_scores,
                            cpos, state.count + started.long(), fade)
    return y, new


def sparse_hybrid_attention_step_ring(
    q, k, qf, kf, v, gamma, state: RingSparseState, *, scale: float, softcap: float | None = None,
    key_mask: torch.Tensor | None = None, priority: str = "recall", anchor: str = "joint",
    log_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RingSparseState]:
    """``sparse_hybrid_attention_step`` on a ``RingSparseState``, in place and without a host
    synchronisation (the epoch's rescoring is computed every step and kept where a boundary falls):
    the same outputs and decisions, token by token."""
    acc = state.linear.dtype
    b, n_kv = k.shape[:2]
    cap, window = state.cache_keys.shape[2], state.keys.shape[2]
    real = key_mask[:, 0] if key_mask is not None else torch.ones(b, dtype=torch.bool, device=k.device)
    kf, v = _real_keys(real[:, None], kf, v)
    started = (state.count > 0) | real
    rel = state.count
    boundary = (started & (rel >= window) & (rel % window == 0))[:, None, None]
    lin = state.linear.squeeze(2)
    new_w, new_c = _rescored(priority, state, state.valid, lin)
    state.window_scores.copy_(torch.where(boundary, new_w, state.window_scores))
    state.cache_scores.copy_(torch.where(boundary, new_c, state.cache_scores))
    if log_gate is not None:  # this step's gate fades the linear state and the cached tokens' pending fades
        lg = log_gate.to(acc)
        state.linear.mul_(lg.exp()[..., None, None])
        if state.cache_fade is None:
            state.cache_fade = torch.zeros_like(state.cache_scores, dtype=acc)
        state.cache_fade.add_(lg)
    # the token in the ring's next slot leaves the window (an empty slot or padding: valid False, no effect)
    idx = state.slot.view(1)
    lk, lf, lv = (x.index_select(2, idx) for x in (state.keys, state.key_features, state.values))
    l_valid = state.valid.index_select(1, idx)[:, None, :].expand(b, n_kv, 1)
    l_pri = state.window_scores.index_select(2, idx)
    l_pos = (rel - window)[:, None, None].expand(b, n_kv, 1)
    ck, cf, cv, cvalid = state.cache_keys, state.cache_features, state.cache_values, state.cache_valid
    cand_valid = torch.cat([cvalid, l_valid], dim=2)
    cand_pri = torch.cat([state.cache_scores, l_pri], dim=2)
    cand_pos = torch.cat([state.cache_pos, l_pos], dim=2)
    full = cand_valid.sum(-1) > cap
    victim = _lowest(cand_pri, cand_pos, cand_valid)
    empty = (~cvalid).long().argmax(-1) if cap else victim
    slot = torch.where(full, victim, empty)
    write = l_valid[..., 0] & (slot < cap)
    pick = (torch.arange(cap + 1, device=k.device) == victim[..., None]).to(acc) * full[..., None]
    weight = pick  # (under gates with the fade the victim gathered in the cache)
    if state.cache_fade is not None:
        weight = pick * torch.cat([state.cache_fade, state.cache_fade.new_zeros(b, n_kv, 1)], dim=2).exp()
    gone_f = (weight[..., None] * torch.cat([cf, lf], dim=2).to(acc)).sum(2, keepdim=True)
    gone_v = (pick[..., None] * torch.cat([cv, lv], dim=2).to(acc)).sum(2, keepdim=True)
    state.linear.add_((gone_f.transpose(-1, -2) @ _augment(gone_v, True)).unsqueeze(2))
    put = (torch.arange(cap, device=k.device) == slot[..., None]) & write[..., None]
    for x, new in ((ck, lk), (cf, lf), (cv, lv)):
        x.copy_(torch.where(put[..., None], new, x))
    state.cache_scores.copy_(torch.where(put, l_pri, state.cache_scores))
    state.cache_pos.copy_(torch.where(put, l_pos, state.cache_pos))
    if state.cache_fade is not None:
        state.cache_fade.masked_fill_(put, 0)
    cvalid.logical_or_(put)
    # the new token takes the slot
    state.keys.index_copy_(2, idx, k.to(state.keys.dtype))
    state.key_features.index_copy_(2, idx, kf.to(state.key_features.dtype))
    state.values.index_copy_(2, idx, v.to(state.values.dtype))
    state.valid.index_copy_(1, idx, real[:, None])
    state.window_scores.index_fill_(2, idx, 0)
    y = _read_one(q, qf, gamma, state.keys, state.values, state.valid, ck, cv, cvalid, state.linear, real, scale,
                  softcap, anchor)
    state.slot.copy_((state.slot + 1) % window)
    state.count.add_(started.long())
    return y, state


def sparse_hybrid_attention_recurrent(q, k, qf, kf, v, gamma, *, window, cache_size, scale, softcap=None,
                                      initial_state=None, key_mask=None, priority="recall", anchor="joint",
                                      log_gate=None):
    """Token by token through ``sparse_hybrid_attention_step`` (the decoding form)."""
    b, h, t, d = q.shape
    state = initial_state or empty_sparse_hybrid_state(b, k.shape[1], d, kf.shape[-1], cache_size,
                                                       device=q.device, dtype=k.dtype, gated=log_gate is not None)
    outs = []
    for i in range(t):
        sl = slice(i, i + 1)
        o, state = sparse_hybrid_attention_step(
            q[:, :, sl], k[:, :, sl], qf[:, :, sl], kf[:, :, sl], v[:, :, sl], gamma, state, window=window,
            scale=scale, softcap=softcap, key_mask=None if key_mask is None else key_mask[:, sl], priority=priority,
            anchor=anchor, log_gate=None if log_gate is None else log_gate[..., sl])
        outs.append(o)
    return torch.cat(outs, dim=2), state
