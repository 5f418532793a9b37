"""The LoLCATs hybrid with a sparse exact cache (after LoLA, McDermott et al. 2025): softmax over the
last ``w`` tokens and over ``S`` older tokens kept exactly, linear attention over all the rest.

Tokens leaving the sliding window go either into the linear state or into a cache of at most ``S``
tokens (raw keys, key features, values), chosen by how badly the linear state recalls them (or, with
``priority="novelty"``, by how unlike the other candidates' their values are; with ``"first"``, the
sequence's first tokens); a cached token pushed out later is folded into the linear state. Memory
stays constant: window + ``S`` tokens + the linear state. With ``S = 0`` this is exactly the hybrid
of ``hybrid_attention.py``.

Output for query t (one shared normaliser, ``gamma`` a per-query-head weight, as in LoLCATs eq. 7):

    a_ts = gamma * exp(s_ts - c_t)      for s in window(t) or cache(t)
    a_ts = phi_q(q_t) . phi_k(k_s)      for every other real s <= t (folded into the linear state)
    y_t  = sum_s a_ts v_s / sum_s a_ts

where ``c_t`` is the largest score over window and cache (``anchor="joint"``, the default). With
``anchor="window"`` the linear terms are scaled by ``exp(c_w - c_t)``, ``c_w`` the largest score over the
window alone: the softmax terms stand against the linear ones as in the hybrid the student was trained
as (whose ``c`` is the window's), and a cached token weighs what it would in the window. Under
``"joint"`` a cached token scoring above the window lowers every softmax term against the linear
terms, the needle's own included.

**Gates** (``log_gate`` ``[B, Hk, T]`` of ``log g_t <= 0``, a fading linear state as in
``hybrid_attention.py``: data-dependent, or a per-head constant for a fixed or learned decay; None is
no fade, every form bit for bit as without). With ``L`` the log gates' cumulative sum, a folded token
``s`` weighs ``exp(L_t - L_{s+w})`` in query t's linear term: its fade starts when it leaves the
window (at time ``s + w``, whose own gate it does not get), as the hybrid's keys' does, whether it is
folded then or later. A cached token does not fade while it is cached (it is a softmax term, like the
window's); pushed out at time ``f``, it is folded with the fade it would have gathered in the linear
state since it left the window, ``exp(L_f - L_{s+w})``. So the state after time t is ``g_t`` times the
one before plus the tokens folded at t, each times ``exp(L_t - L_{s+w})``, and with ``S = 0`` (every
token folded at ``s + w``) this is exactly the gated hybrid. The decoding state holds, per cached
token, the log fade it has gathered since it left the window (``cache_fade``: 0 on arrival, each step
adds its log gate; a short sum rather than the difference of two long cumulative sums). The recall
priority reads the faded state (at a boundary ``b``, the state after time ``b - 1``).

**Features** ``qf``, ``kf`` are the caller's: computed from the rotated q/k or, with ``feature_rope:
false``, from the q/k before RoPE while the scores use the rotated ones. No form recomputes a
feature from a stored key: the window and the cache keep each token's key features beside its key.

**Which tokens are cached** is decided per sequence and per *key head* (the ``G`` query heads of a
group share their key head's cache, as they share its keys, values and linear state):

* Origin ``p``: the sequence's first real token. Epochs of ``w`` tokens start at the boundaries
  ``b_m = p + m w`` (``m >= 1``); padding before ``p`` takes no part.
* At each boundary, against the linear state ``(N, z) = sum phi_k(k_s) [v_s, 1]`` of the tokens
  folded so far, every current cache member and every token that will leave the window during the
  epoch (the ``w`` tokens before ``b_m``, all in the window at that moment) gets the priority

      pi_x = || v_x - phi_k(k_x) N / (phi_k(k_x) . z) ||_2       (0 readout while z is empty)

  LoLA's self-recall error: the key, used as a query of the linear state, should read back its own
  value; the worse it does, the more the token needs an exact copy (``priority="recall"``, the
  default). ``priority="novelty"`` ranks the same candidates by how unlike every other candidate
  (the current cache and the epoch's leavers, all held exactly at the boundary) their values are:

      pi_x = - max_{y candidate, y != x} cos(v_x, v_y)          (1 when x is the only candidate)

  Text that repeats (filler, boilerplate) has near-copies among the candidates and goes to the
  linear state; a one-off token (a pass key's digits) has none and stays. Like the self-recall
  error it needs no training, and it reads only what the cache holds anyway. It is a lead, not a
  result: a CPU diagnosis (a briefly trained SmolLM2 student, a few passkey prompts, S = 256,
  selection replayed offline; issue #21) found the self-recall error often dropping
  some of the key's digits where value novelty kept them; end to end the student then recalled more
  of the key from 512-token prompts but still not from 1,024-token ones. On trained students (the
  GPU dial, ``docs/reports/dial.md``) it triples S = 64's passkey.
  ``priority="first"`` ranks them by age, older first (``pi_x = -x``, positions from the origin):
  no newcomer ever outranks a cached token, so the cache keeps the sequence's first ``S`` tokens
  for good, the "attention sinks" StreamingLLM keeps beside its window.
  Priorities are fixed for the epoch; ties go to the younger token (higher position wins).
* At each time t, token ``t - w`` leaves the window (if real) and joins the cache; if the cache then
  holds ``S + 1`` tokens, the one of lowest priority is folded into the linear state (it may be the
  newcomer). With fixed priorities this keeps, at every t, the top ``S`` of the epoch's members and
  arrivals so far, so a chunk of ``w`` queries can decide all its evictions at once.
* Query t sees the cache and linear state after time t's eviction. Padding queries output zero.

Selection is not differentiable (priorities are computed without gradients); the output is, through
the softmax over window and cache and through the linear state.

Three forms, equal in float64 (tests): ``sparse_hybrid_attention_naive`` (a literal simulation with
sets of positions, explicit sums), ``sparse_hybrid_attention_chunked`` (chunks of ``w`` tokens, one
epoch each: a loop over chunks, everything inside a chunk batched) and
``sparse_hybrid_attention_step`` (one token; the decoding state ``SparseHybridState``). The chunked
form counts epochs from each sequence's own origin (a left-padded batch decides exactly as each
sequence alone): it rolls each sequence left by ``p mod w`` so that every origin falls on a chunk
boundary.

Shapes as in ``hybrid_attention.py``: ``q`` ``[B, H, T, D]``, ``k`` and ``v`` ``[B, Hk, T, D]``,
``qf`` ``[B, H, T, F]``, ``kf`` ``[B, Hk, T, F]``, ``gamma`` ``[H]``, ``log_gate`` ``[B, Hk, T]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .hybrid_attention import (FusedRingState, HybridState, RingHybridState, _real_keys, _scores, hybrid_final_state,
                               pad_front)
from .hybrid.state import SparseHybridState  # noqa: F401  (defined beside HybridState: the kernels build it too)
from .linear_attention import _augment, _group, accum_dtype


def empty_sparse_hybrid_state(batch, n_kv, head_dim, feature_dim, cache_size, *, device=None,
                              dtype=torch.float32, gated: bool = False) -> SparseHybridState:
    """An empty state; ``gated``: with the cached tokens' fades (a fading linear state)."""
    acc = accum_dtype(dtype)
    z = lambda *s, dt=dtype: torch.zeros(batch, n_kv, *s, device=device, dtype=dt)  # noqa: E731
    return SparseHybridState(
        z(0, head_dim), z(0, feature_dim), z(0, head_dim), torch.zeros(batch, 0, dtype=torch.bool, device=device),
        z(0, dt=acc), z(1, feature_dim, head_dim + 1, dt=acc),
        z(cache_size, head_dim), z(cache_size, feature_dim), z(cache_size, head_dim), z(cache_size, dt=torch.bool),
        z(cache_size, dt=acc), z(cache_size, dt=torch.long), torch.zeros(batch, dtype=torch.long, device=device),
        z(cache_size, dt=acc) if gated else None)


PRIORITY_GRID = 2.0 ** -16  # recall errors and value_novelty's cosines are rounded to multiples of this


def recall_error(kf: torch.Tensor, v: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """LoLA's self-recall error ``||v - phi(k) N / phi(k) . z||`` of tokens ``kf`` ``[B, Hk, M, F]``,
    ``v`` ``[B, Hk, M, D]`` against a linear state ``[B, Hk, F, D + 1]``: ``[B, Hk, M]``. The readout is
    zero where the state holds nothing for the key (``phi(k) . z = 0``). Computed in the state's
    precision, under autocast too, and rounded to ``PRIORITY_GRID``: copies (a repeated token's key and
    value in the first layer) then tie exactly in every form, whatever the shape of the product that
    each form reads them from, and the tie rule decides (a prefill and the decoding steps after it
    evicted different copies of a repeated token before)."""
    with torch.autocast(linear.device.type, enabled=False):
        out = kf.to(linear.dtype) @ linear
        read = out[..., :-1] / out[..., -1:].clamp_min(torch.finfo(linear.dtype).tiny)
        return torch.round((v.to(linear.dtype) - read).norm(dim=-1) / PRIORITY_GRID) * PRIORITY_GRID


def value_novelty(v: torch.Tensor, valid: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``-max cos(v_x, v_y)`` over the other valid candidates y of each candidate x: ``v`` ``[B, Hk, M,
    D]``, ``valid`` ``[B, Hk, M]`` -> ``[B, Hk, M]`` in ``acc`` (1 where x has no other candidate; an
    all-zero value has cosine 0 with everything). The cosines are rounded to ``PRIORITY_GRID``: copies
    (a repeated token's values in the first layer) then tie exactly in every form, and the tie rule
    decides, not the rounding of the form's own sums. Computed outside autocast."""
    with torch.autocast(v.device.type, enabled=False):
        x = v.to(acc)
        x = x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)
        sim = torch.round(x @ x.transpose(-1, -2) / PRIORITY_GRID) * PRIORITY_GRID
        m = v.shape[-2]
        others = valid[..., None, :] & ~torch.eye(m, dtype=torch.bool, device=v.device)
        best = sim.masked_fill(~others, -torch.inf).amax(dim=-1)
        return -torch.where(others.any(dim=-1), best, -1.0)


PRIORITIES = ("recall", "novelty", "first")
ANCHORS = ("joint", "window")


def _check(priority: str, anchor: str) -> None:
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    if anchor not in ANCHORS:
        raise ValueError(f"anchor must be one of {', '.join(ANCHORS)}, got {anchor!r}")


def priorities(kind: str, kf: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, linear: torch.Tensor,
               pos: torch.Tensor) -> torch.Tensor:
    """The epoch's priorities of one candidate set (``kf`` ``[B, Hk, M, F]``, ``v`` ``[B, Hk, M, D]``,
    ``valid`` ``[B, Hk, M]``, the linear state ``[B, Hk, F, D + 1]``, positions from the origin
    ``pos`` ``[B, Hk, M]``): ``recall_error`` (``kind = "recall"``), ``value_novelty`` among the valid
    candidates (``"novelty"``) or minus the position (``"first"``: the older, the higher). ``[B, Hk, M]``."""
    if kind == "recall":
        return recall_error(kf, v, linear)
    if kind == "novelty":
        return value_novelty(v, valid, linear.dtype)
    if kind == "first":
        return -pos.to(linear.dtype)
    raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {kind!r}")


def _beaten_by(pri: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[..., x, y]``: candidate y (valid) outranks candidate x (higher priority; ties: younger)."""
    px, py = pri[..., :, None], pri[..., None, :]
    younger = pos[..., None, :] > pos[..., :, None]
    return valid[..., None, :] & ((py > px) | ((py == px) & younger))


def _lowest(pri: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Index of the lowest-ranked valid candidate along the last dim (ties: the older)."""
    p = pri.masked_fill(~valid, float("inf"))
    tie = (p == p.amin(-1, keepdim=True)) & valid
    return pos.masked_fill(~tie, torch.iinfo(pos.dtype).max).argmin(-1)


# --- the reference -------------------------------------------------------------------------------

def _on_grid(x: torch.Tensor) -> float:
    """A priority rounded to ``PRIORITY_GRID`` as the batched forms round theirs."""
    return float(torch.round(x / PRIORITY_GRID) * PRIORITY_GRID)


def sparse_hybrid_attention_naive(q, k, qf, kf, v, gamma, *, window: int, cache_size: int, scale: float,
                                  softcap: float | None = None, key_mask: torch.Tensor | None = None,
                                  priority: str = "recall", anchor: str = "joint",
                                  log_gate: torch.Tensor | None = None):
    """The definition, literally: per sequence and key head, sets of positions (window, cache,
    folded) evolve token by token, and every output is an explicit sum (a folded token ``s`` weighs
    ``exp(L_t - L_{s+w})`` in query t's and the boundary's sums under gates). Slow (Python loops over
    tokens): for tests. Returns ``[B, H, T, D]``."""
    _check(priority, anchor)
    acc = accum_dtype(q.dtype)
    b, n_kv, t, d = k.shape
    group = q.shape[1] // n_kv
    w, cap = window, cache_size
    real = key_mask if key_mask is not None else torch.ones(b, t, dtype=torch.bool, device=q.device)
    real_l = real.tolist()
    out_dtype = q.dtype
    q, k, qf, kf, v = (x.to(acc) for x in (q, k, qf, kf, v))
    gamma = gamma.to(acc)
    cum = log_gate.to(acc).cumsum(-1) if log_gate is not None else None  # L: [B, Hk, T]
    rows = []
    for bi in range(b):
        heads = []
        for hk in range(n_kv):
            cached, folded, pri, origin = [], [], {}, None

            def fade(now):  # each folded token's weight in the linear state after time ``now``
                if cum is None:
                    return torch.ones(len(folded), dtype=acc, device=q.device)
                starts = torch.tensor(folded, dtype=torch.long, device=q.device) + w
                return torch.exp(cum[bi, hk, now] - cum[bi, hk, starts])
            outs = []
            for ti in range(t):
                if origin is None and real_l[bi][ti]:
                    origin = ti
                rel = ti - origin if origin is not None else -1
                if rel >= w and rel % w == 0:  # a boundary: priorities against the folded tokens
                    with torch.no_grad():
                        fk = kf[bi, hk, folded] * fade(ti - 1)[:, None]  # the state after time ti - 1
                        num, den = fk.T @ v[bi, hk, folded], fk.sum(0)
                        cands = cached + [s for s in range(ti - w, ti) if real_l[bi][s]]
                        unit = {s: v[bi, hk, s] / v[bi, hk, s].norm().clamp_min(torch.finfo(acc).tiny) for s in cands}
                        for s in cands:
                            if priority == "first":  # the older, the higher
                                pri[s] = -float(s - origin)
                                continue
                            if priority == "novelty":  # the most similar other candidate's cosine, negated
                                pri[s] = -max((_on_grid(unit[s] @ unit[y]) for y in cands if y != s), default=-1.0)
                                continue
                            f_s = kf[bi, hk, s]
                            dn = f_s @ den
                            read = (f_s @ num) / dn if dn > 0 else torch.zeros_like(v[bi, hk, s])
                            pri[s] = _on_grid((v[bi, hk, s] - read).norm())
                s = ti - w
                if s >= 0 and real_l[bi][s]:  # the oldest window token leaves
                    cached.append(s)
                    if len(cached) > cap:
                        victim = min(cached, key=lambda x: (pri[x], x))
                        cached.remove(victim)
                        folded.append(victim)
                if not real_l[bi][ti]:
                    outs.append(torch.zeros(group, d, dtype=acc, device=q.device))
                    continue
                in_window = [x for x in range(max(0, ti - w + 1), ti + 1) if real_l[bi][x]]
                soft = in_window + cached
                per_head = []
                for gi in range(group):
                    hq = hk * group + gi
                    sc = _scores(q[bi, hq, ti][None], k[bi, hk, soft], scale, softcap)[0]
                    a_soft = gamma[hq] * torch.exp(sc - sc.max())
                    a_lin = (kf[bi, hk, folded] @ qf[bi, hq, ti]) * fade(ti)
                    if anchor == "window":  # the linear terms against the window's largest score
                        a_lin = a_lin * torch.exp(sc[: len(in_window)].max() - sc.max())
                    num = a_soft @ v[bi, hk, soft] + a_lin @ v[bi, hk, folded]
                    per_head.append(num / (a_soft.sum() + a_lin.sum()))
                outs.append(torch.stack(per_head))
            heads.append(torch.stack(outs, dim=1))  # [G, T, D]
        rows.append(torch.cat(heads))
    return torch.stack(rows).to(out_dtype)


# --- decoding --------------------------------------------------------------------------------------

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


def _rescored(kind, state, window_valid, lin):
    """The boundary's priorities of the window's tokens and the cache's (one candidate set):
    ``(window [B, Hk, n], cache [B, Hk, S])``. The window's newest token is at position ``count - 1``;
    a ring's oldest sits in its next slot."""
    n = state.values.shape[2]
    b, n_kv = state.values.shape[:2]
    age = torch.arange(n, device=state.count.device)  # 0: the oldest
    if isinstance(state, RingSparseState):
        age = (age - state.slot) % n
    pos = (state.count[:, None] - n + age)[:, None, :].expand(b, n_kv, n)
    pri = priorities(kind, torch.cat([state.key_features, state.cache_features], dim=2),
                     torch.cat([state.values, state.cache_values], dim=2),
                     torch.cat([window_valid[:, None, :].expand(b, n_kv, n), state.cache_valid], dim=2), lin,
                     torch.cat([pos, state.cache_pos], dim=2))
    return pri[..., :n], pri[..., n:]


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


@dataclass
class RingSparseState(SparseHybridState):
    """A ``SparseHybridState`` whose window is a fixed ring of exactly ``w`` slots, updated in place with
    the cache (the fast decoder's form: every step has the same shapes and touches the same buffers,
    what a CUDA graph needs). Empty slots hold zeros and ``valid = False``; ``slot`` (a 0-d long
    tensor) is the next slot to overwrite, whose token is the one leaving the window."""

    slot: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*super().tensors(), self.slot)

    def map(self, fn) -> "RingSparseState":
        return RingSparseState(*(fn(x) for x in super().tensors()), slot=self.slot.clone())

    @classmethod
    def from_state(cls, state: SparseHybridState, window: int) -> "RingSparseState":
        """A ring holding ``state``'s window, oldest first with the empty slots in front (slot 0 is
        overwritten first); the ring owns ``state``'s tensors afterwards."""
        have = state.keys.shape[2]
        if have > window:
            raise ValueError(f"the state holds {have} window tokens, more than the window ({window})")
        front = lambda x, dim: pad_front(x, dim, window - have).contiguous()  # noqa: E731

        rest = [x.contiguous() for x in state.tensors()[5:]]
        return cls(front(state.keys, 2), front(state.key_features, 2), front(state.values, 2), front(state.valid, 1),
                   front(state.window_scores, 2), *rest,
                   slot=torch.zeros((), dtype=torch.long, device=state.keys.device))


@dataclass
class FusedSinkState(FusedRingState):
    """The fused decode step's state (``FusedRingState``) beside a cache that no longer changes: the
    sequence's first ``S`` tokens under ``priority="first"`` once every sequence's have left the window
    (a newcomer then never outranks them: each token leaving the window is folded into the linear
    state, as in the hybrid without a cache). ``hybrid_step_fused_triton`` adds them to the window's
    softmax, the same step as ``sparse_hybrid_attention_step_ring`` on that state.

    * ``sink_keys``, ``sink_values`` ``[B, Hk, S, D]``: the cached tokens (keys after RoPE);
    * ``sink_valid`` ``[B, Hk, S]`` bool.
    """

    sink_keys: torch.Tensor | None = None
    sink_values: torch.Tensor | None = None
    sink_valid: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*super().tensors(), self.sink_keys, self.sink_values, self.sink_valid)

    def map(self, fn) -> "FusedSinkState":
        ring = super().map(fn)
        return FusedSinkState(*HybridState.tensors(ring), slot=ring.slot, ticks=ring.ticks,
                              sink_keys=fn(self.sink_keys), sink_values=fn(self.sink_values),
                              sink_valid=fn(self.sink_valid))

    @staticmethod
    def settled(state: SparseHybridState, priority: str) -> bool:
        """Whether ``state``'s cache will not change again: ``priority="first"`` with every slot of
        every sequence and key head taken (reads a flag on the host)."""
        return priority == "first" and state.cache_keys.shape[2] > 0 and bool(state.cache_valid.all())

    @classmethod
    def from_sparse(cls, state: SparseHybridState, window: int, key_feature_map, n_heads: int,
                    splits: int = 1) -> "FusedSinkState":
        """The fused step's state from a prefill's ``state`` whose cache is ``settled`` (its window, linear
        state and cache are taken over; the window's key features are dropped)."""
        plain = HybridState(state.keys, state.key_features, state.values, state.linear, state.valid)
        ring = RingHybridState.from_state(plain, window, keep_key_features=False, copy=False)
        fused = FusedRingState.from_ring(ring, key_feature_map, n_heads, splits)
        return cls(*HybridState.tensors(fused), slot=fused.slot, ticks=fused.ticks,
                   sink_keys=state.cache_keys.contiguous(), sink_values=state.cache_values.contiguous(),
                   sink_valid=state.cache_valid.contiguous())


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


# --- prefill and training ---------------------------------------------------------------------------

def _roll_left(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, T, *]`` with sequence b read at positions ``idx[b]`` ``[B, T]``."""
    return x.gather(2, idx[:, None, :, None].expand(x.shape[0], x.shape[1], -1, x.shape[3]))


def _take(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Tokens of ``x`` ``[B, Hk, T, E]`` at positions ``pos`` ``[B, Hk, *P]``: ``[B, Hk, *P, E]``."""
    flat = pos.flatten(2)
    out = x.gather(2, flat[..., None].expand(-1, -1, -1, x.shape[-1]))
    return out.view(*pos.shape, x.shape[-1])


@torch.no_grad()
def _select_first(real: torch.Tensor, n_kv: int, w: int, cap: int):
    """``_select``'s ``fold``, ``slot_pos`` and ``slot_valid`` under ``priority="first"``, in closed form
    (no loop over chunks): the first ``S`` real tokens are never folded (no newcomer outranks them);
    every later real token is folded the moment it leaves the window, at ``s + w`` (the cache already
    holds the S older ones), and a token of the last chunk never leaves. The cache at chunk c's start
    holds the first tokens that left by then (``s < (c - 1) w``), in position order. Slots that hold
    nothing point at position 0. ``real`` ``[B, N w]`` (origins on chunk boundaries)."""
    b, tp = real.shape
    n, dev = tp // w, real.device
    pos = torch.arange(tp, device=dev)
    first = real & (real.long().cumsum(-1) <= cap)  # the first S real tokens
    fold = torch.where(real & ~first & (pos + w < tp), pos + w, tp + w)
    order = torch.where(first, pos, tp).sort(dim=-1).values  # their positions, ascending; tp: none
    order = F.pad(order, (0, max(0, cap - tp)), value=tp)[:, :cap]  # [B, S]
    starts = (torch.arange(n, device=dev) - 1) * w  # [N]: a slot holds its token once s < (c - 1) w
    slot_valid = (order < tp)[:, None, :] & (order[:, None, :] < starts[None, :, None])  # [B, N, S]
    slot_pos = torch.where(slot_valid, order[:, None, :], 0)
    expand = lambda x: x[:, None].expand(b, n_kv, *x.shape[1:])  # noqa: E731  one decision per key head
    return expand(fold), expand(slot_pos), expand(slot_valid)


@torch.no_grad()
def _select(kf: torch.Tensor, v: torch.Tensor, real: torch.Tensor, w: int, cap: int, priority: str = "recall",
            cum: torch.Tensor | None = None, with_order: bool = False):
    """The cache decisions over chunks of ``w`` tokens (one epoch each), whose origins are on chunk
    boundaries. ``kf`` ``[B, Hk, N w, F]``, ``v`` ``[B, Hk, N w, D]``, ``real`` ``[B, N w]``.

    Returns ``fold`` ``[B, Hk, N w]`` (the time each token is folded into the linear state; ``N w +
    w`` for never), and per chunk the cache at its start, ``slot_pos`` / ``slot_valid`` ``[B, Hk, N,
    S]``, and the epoch's priorities of its ``S + w`` candidates (slots, then chunk c-1's tokens),
    ``pri`` ``[B, Hk, N, S + w]``; ``with_order``: also ``order`` ``[B, Hk, N, S]``, which of chunk c's
    candidates each slot of chunk c + 1's cache is.

    With gates, ``cum`` ``[B, Hk, N, w]`` (the log gates' cumulative sums within each chunk): the
    linear state the priorities read is faded (at each chunk's start, the state after the time
    before), each slot carrying the fade its token gathered since it left the window.

    Inside chunk c, with the epoch's priorities fixed, candidate x (present from the start, or
    arriving as leaver j at step j) is cached at step i while fewer than ``S`` of the candidates
    that have arrived by i outrank it, and folded from the step that count reaches ``S``: one
    comparison matrix and a cumulative sum, no loop inside the chunk.
    """
    b, n_kv, tp, f = kf.shape
    n, dev, acc = tp // w, kf.device, accum_dtype(kf.dtype)
    steps = torch.arange(w, device=dev)
    arrived_at = torch.cat([torch.full((cap,), -1, device=dev), steps])[:, None] <= steps  # [M, w]
    never = tp + w
    fold = torch.full((b, n_kv, tp + 1), never, dtype=torch.long, device=dev)  # + a sink for "no write"
    lin = torch.zeros(b, n_kv, f, v.shape[-1] + 1, dtype=acc, device=dev)
    slot_pos = torch.zeros(b, n_kv, cap, dtype=torch.long, device=dev)
    slot_valid = torch.zeros(b, n_kv, cap, dtype=torch.bool, device=dev)
    rec_pos, rec_valid, rec_pri, rec_order = [], [], [], []
    slot_fade = torch.zeros(b, n_kv, cap, dtype=acc, device=dev)  # log fade up to the chunk's start
    origin = real.long().argmax(-1)[:, None, None]  # the first real token (on a chunk boundary here)
    for c in range(n):
        rec_pos.append(slot_pos)
        rec_valid.append(slot_valid)
        leavers = ((c - 1) * w + steps).clamp_min(0)
        l_valid = real[:, leavers] if c else torch.zeros(b, w, dtype=torch.bool, device=dev)
        pos = torch.cat([slot_pos, leavers.expand(b, n_kv, w)], dim=2)  # [B, Hk, M]
        valid = torch.cat([slot_valid, l_valid[:, None].expand(b, n_kv, w)], dim=2)
        cand_f, cand_v = _take(kf, pos).to(acc), _take(v, pos).to(acc)
        pri = priorities(priority, cand_f, cand_v, valid, lin, pos - origin)
        rec_pri.append(pri)
        beaten = _beaten_by(pri, pos, valid)  # [B, Hk, M, M]
        rivals = beaten[..., :cap].sum(-1, keepdim=True) + beaten[..., cap:].long().cumsum(-1)  # [B, Hk, M, w]
        arrived = valid[..., None] & arrived_at
        kept, gone = arrived & (rivals < cap), arrived & (rivals >= cap)
        out = gone[..., -1]  # folded during this chunk (once folded, always: rivals only grow)
        when = c * w + gone.long().argmax(-1)
        fold.scatter_(2, torch.where(out, pos, tp), when)
        order = torch.argsort(kept[..., -1].long(), dim=-1, descending=True, stable=True)[..., :cap]
        rec_order.append(order)
        with torch.autocast(dev.type, enabled=False):
            if cum is None:
                lin = lin + (cand_f * out[..., None]).transpose(-1, -2) @ _augment(cand_v, True)
            else:  # each candidate's fade at the chunk's end: the state after its last token
                end = _fades_at_end(slot_fade, cum[:, :, c])
                weight = out * end.exp()
                lin = cum[:, :, c, -1:, None].exp() * lin + (cand_f * weight[..., None]).transpose(-1, -2) @ _augment(
                    cand_v, True)
                slot_fade = end.gather(2, order)
        slot_pos, slot_valid = pos.gather(2, order), kept[..., -1].gather(2, order)
    result = fold[..., :tp], torch.stack(rec_pos, 2), torch.stack(rec_valid, 2), torch.stack(rec_pri, 2)
    return (*result, torch.stack(rec_order, 2)) if with_order else result


def _fades_at_end(slot_fade: torch.Tensor, cum: torch.Tensor) -> torch.Tensor:
    """The log fades ``[B, Hk, S + w]`` at a chunk's last token of its candidates: the slots
    (``slot_fade`` ``[B, Hk, S]``, their fades at the chunk's start) and chunk c-1's tokens, which
    leave the window at the chunk's steps j and fade from then (``cum`` ``[B, Hk, w]``, the chunk's
    cumulative log gates: ``exp(cum[-1] - cum[j])``)."""
    total = cum[..., -1:]
    return torch.cat([slot_fade + total, total - cum], dim=2)


def sparse_hybrid_attention_chunked(
    q, k, qf, kf, v, gamma, *, window: int, cache_size: int, scale: float, softcap: float | None = None,
    output_final_state: bool = False, key_mask: torch.Tensor | None = None, priority: str = "recall",
    anchor: str = "joint", log_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SparseHybridState | None]:
    """The sequence form, in chunks of ``window`` tokens, one selection epoch each.

    First the decisions (``_select``: a loop over chunks without gradients, carrying the linear
    state and the cache's positions), which fix for every token the time it is folded into the
    linear state. The attention is then a function of those times, for all chunks at once: chunk
    c's queries see the keys of chunks c-1 and c (the window, exactly masked; chunk c-1's tokens
    once they leave it are cached or folded by their fold time), the cache at the chunk's start
    (cached or folded during the chunk), and the linear state of the tokens folded before the
    chunk (a cumulative sum of per-chunk sums).

    With gates (``log_gate`` ``[B, Hk, T]``) every fade is a sum of log gates within one chunk or
    carried from chunk to chunk, as in ``hybrid_attention_chunked``: query i of chunk c weighs chunk
    c-1's token j (folded by then) by ``exp(G_c[i] - G_c[j])``, a slot of the chunk's starting cache
    by ``exp(A + G_c[i])`` (``A`` its fade at the chunk's start, carried along the slots' order), and
    the state ``E_c`` of the tokens folded before the chunk by ``exp(G_c[i])``; ``E_{c+1} =
    exp(G_c[-1]) E_c + (chunk c's folds, each faded to the chunk's end)``.
    """
    _check(priority, anchor)
    acc = accum_dtype(q.dtype)
    b, n_kv, t, d = k.shape
    grp = q.shape[1] // n_kv
    w, cap = window, cache_size
    dev = q.device
    orig = (k, kf, v)
    kf, v = _real_keys(key_mask, kf, v)
    real = key_mask if key_mask is not None else torch.ones(b, t, dtype=torch.bool, device=dev)
    has = real.any(dim=1)
    first = torch.where(has, real.long().argmax(dim=1), torch.zeros_like(has, dtype=torch.long))
    shift = first % w  # roll each sequence left so that its origin falls on a chunk boundary
    rolled = key_mask is not None and bool(shift.any())  # (no host sync without a mask)
    gated = log_gate is not None
    if rolled:
        idx = (torch.arange(t, device=dev)[None, :] + shift[:, None]) % t
        q, k, qf, kf, v = (_roll_left(x, idx) for x in (q, k, qf, kf, v))
        real = real.gather(1, idx)
        if gated:
            log_gate = _roll_left(log_gate[..., None], idx)[..., 0]
    n = -(-t // w)
    tp = n * w
    pad = tp - t
    flat = lambda x: F.pad(x.to(acc), (0, 0, 0, pad))  # noqa: E731  [B, *, Tp, E]
    kk, ff, vv = flat(k), flat(kf), flat(v)
    rr = F.pad(real, (0, pad))
    cum = F.pad(log_gate.to(acc), (0, pad)).unflatten(2, (n, w)).cumsum(-1) if gated else None  # [B, Hk, N, w]
    if priority == "first" and not output_final_state and not gated:  # the decisions in closed form
        (fold, slot_pos, slot_valid), pri = _select_first(rr, n_kv, w, cap), None  # (the state needs pri)
    else:
        fold, slot_pos, slot_valid, pri, order = _select(ff, vv, rr, w, cap, priority,
                                                         None if cum is None else cum.detach(), with_order=True)

    qc = flat(_group(q, n_kv).flatten(1, 2)).view(b, n_kv, grp, n, w, d)
    qfc = flat(_group(qf, n_kv).flatten(1, 2)).view(b, n_kv, grp, n, w, -1)
    # keys of chunks (c-1, c) for chunk c: one chunk of padding in front, overlapping pairs
    pairs = lambda x, fill=0: F.pad(x, (w, 0), value=fill).unfold(-1, 2 * w, w)  # noqa: E731  on the last dim
    k2, f2, v2 = (pairs(x.transpose(-1, -2)).movedim(2, -1).unsqueeze(2) for x in (kk, ff, vv))  # [B, Hk, 1, N, 2w, *]
    fold2 = pairs(fold, tp + w)  # [B, Hk, N, 2w]
    real2 = pairs(rr, False)  # [B, N, 2w]
    steps = torch.arange(w, device=dev)
    jj = torch.arange(2 * w, device=dev)
    now = (torch.arange(n, device=dev) * w)[:, None] + steps  # [N, w]: the queries' times
    in_window = (jj > steps[:, None]) & (jj <= steps[:, None] + w)  # [w, 2w]
    left = jj <= steps[:, None]  # chunk c-1's token j has left the window at step i >= j
    folded2 = left & (fold2[..., None, :] <= now[..., None])  # [B, Hk, N, w, 2w]
    soft2 = ((in_window & real2[:, None, :, None, :]) | (left & real2[:, None, :, None, :] & ~folded2))

    g = gamma.to(acc).reshape(n_kv, grp)[..., None, None, None]  # [Hk, G, 1, 1, 1]
    s2 = _scores(qc, k2, scale, softcap)  # [B, Hk, G, N, w, 2w]; under autocast in its half dtype
    neg = torch.finfo(s2.dtype).min
    s2 = s2.masked_fill(~soft2[:, :, None], neg)
    top = s2.amax(dim=-1, keepdim=True)
    if anchor == "window":  # the window's largest score (its keys are among chunks c-1 and c)
        win2 = (in_window & real2[:, None, :, None, :])[:, :, None]
        top_w = s2.masked_fill(~win2, neg).amax(dim=-1, keepdim=True)
    if cap:  # the cache at each chunk's start
        sk, sf, sv = _take(kk, slot_pos), _take(ff, slot_pos), _take(vv, slot_pos)  # [B, Hk, N, S, *]
        s_fold = fold.gather(2, slot_pos.flatten(2)).view_as(slot_pos)
        folded_s = slot_valid[..., None, :] & (s_fold[..., None, :] <= now[..., None])  # [B, Hk, N, w, S]
        soft_s = slot_valid[..., None, :] & ~folded_s
        ss = _scores(qc, sk.unsqueeze(2), scale, softcap).masked_fill(~soft_s[:, :, None], neg)
        top = torch.maximum(top, ss.amax(dim=-1, keepdim=True))
    lin = torch.exp(top_w - top) if anchor == "window" else 1.0  # the linear terms' factor
    lin2 = (qfc @ f2.transpose(-1, -2)) * folded2[:, :, None] * lin
    if gated:  # chunk c-1's token j, folded, faded from its step j in chunk c
        diff = cum[..., :, None] - cum[..., None, :]
        fade2 = torch.where(left[:, :w], diff, torch.full_like(diff, float("-inf"))).exp()  # [B, Hk, N, w, w]
        lin2 = lin2 * F.pad(fade2, (0, w)).unsqueeze(2)
    a2 = g * torch.exp(s2 - top) * soft2[:, :, None] + lin2
    out = a2 @ _augment(v2, True)
    # linear state before each chunk: tokens folded during chunk c are among its candidates
    ends = ((torch.arange(n, device=dev) + 1) * w)[:, None]  # [N, 1]
    gone2 = (fold2[..., :w] < ends).to(acc)[..., None]  # chunk c-1's tokens folded by the chunk's end
    if gated:  # each faded to the chunk's end
        gone2 = gone2 * (cum[..., -1:] - cum).exp()[..., None]
    inc = (f2[:, :, 0, :, :w] * gone2).transpose(-1, -2) @ _augment(v2[:, :, 0, :, :w], True)  # [B, Hk, N, F, D+1]
    if cap:
        lin_s = (qfc @ sf.unsqueeze(2).transpose(-1, -2)) * folded_s[:, :, None] * lin
        gone_s = (slot_valid & (s_fold < ends)).to(acc)[..., None]
        if gated:  # a slot's fade at the chunk's start, carried along the slots' order (with its gradient)
            slot_fade, fades = torch.zeros_like(cum[:, :, 0, :1]).expand(-1, -1, cap), []
            for c in range(n):
                fades.append(slot_fade)
                slot_fade = _fades_at_end(slot_fade, cum[:, :, c]).gather(2, order[:, :, c])
            a_fade = torch.stack(fades, 2)  # [B, Hk, N, S]
            lin_s = lin_s * (a_fade[..., None, :] + cum[..., None]).exp().unsqueeze(2)
            gone_s = gone_s * (a_fade + cum[..., -1:]).exp()[..., None]
        a_s = g * torch.exp(ss - top) * soft_s[:, :, None] + lin_s
        out = out + a_s @ _augment(sv, True).unsqueeze(2)
        inc = inc + (sf * gone_s).transpose(-1, -2) @ _augment(sv, True)
    if gated:  # E_c, the state at chunk c's start, read by query i with the fade exp(G_c[i])
        states = [torch.zeros_like(inc[:, :, :1])]
        for c in range(n - 1):
            states.append(cum[:, :, c : c + 1, -1:, None].exp() * states[-1] + inc[:, :, c : c + 1])
        before = torch.cat(states, dim=2)
        out = out + ((qfc * cum.exp()[:, :, None, ..., None]) @ before.unsqueeze(2)) * lin
    else:
        before = torch.cumsum(inc, dim=2) - inc
        out = out + (qfc @ before.unsqueeze(2)) * lin
    y = out[..., :-1] / out[..., -1:].clamp_min(torch.finfo(acc).tiny)
    y = y.flatten(3, 4)[..., :t, :] * real[:, None, None, :, None]  # [B, Hk, G, T, D]
    y = y.reshape(b, -1, t, d)
    if rolled:  # back to the caller's positions
        back = (torch.arange(t, device=dev)[None, :] - shift[:, None]) % t
        y = _roll_left(y, back)
    y = y.to(q.dtype)
    if not output_final_state:
        return y, None
    selection = (kk, ff, vv, rr, fold, slot_pos, slot_valid, pri)
    gates = None if not gated else F.pad(log_gate.to(acc), (0, pad))
    return y, _final_state(orig, key_mask, selection, w, cap, first, shift, has, t, gates)


def _final_state(orig, key_mask, sel, w, cap, first, shift, has, t, log_gate=None) -> SparseHybridState:
    """The decoding state after the prompt: its last ``w`` tokens raw (with the priorities that those
    leaving in the current epoch got at its boundary), and the cache and linear state after its last
    token (each sequence's own, from the chunk that holds it). ``log_gate`` ``[B, Hk, N w]``, rolled:
    the folded tokens faded to the last token, and the cached ones' fades so far."""
    k, kf, v = orig
    kk, ff, vv, rr, fold, slot_pos, slot_valid, pri = sel
    window = hybrid_final_state(k, kf, v, w, key_mask)
    b, n_kv = k.shape[:2]
    dev = k.device
    steps = torch.arange(w, device=dev)
    last = t - 1 - shift  # each sequence's last token, rolled
    c, i = last // w, last % w
    at = lambda x: x.gather(2, c.view(b, 1, 1, 1).expand(b, n_kv, 1, x.shape[-1]))[:, :, 0]  # noqa: E731
    # the candidates of the last token's epoch: the chunk's starting cache and chunk c-1's tokens
    pos = torch.cat([at(slot_pos), ((c - 1)[:, None] * w + steps).clamp_min(0)[:, None].expand(b, n_kv, w)], dim=2)
    leaving = (steps <= i[:, None]) & (c[:, None] >= 1)  # [B, w]: chunk c-1's tokens that have left
    leaving = leaving & rr.gather(1, pos[:, 0, cap:])
    valid = torch.cat([at(slot_valid), leaving[:, None].expand(b, n_kv, w)], dim=2)
    in_cache = valid & (fold.gather(2, pos) > last[:, None, None])
    order = torch.argsort(in_cache.long(), dim=-1, descending=True, stable=True)[..., :cap]
    c_pos, c_valid, c_pri = pos.gather(2, order), in_cache.gather(2, order), at(pri).gather(2, order)
    folded = (fold <= last[:, None, None]).to(ff.dtype)[..., None]  # [B, Hk, Tp, 1]
    c_fade = None
    if log_gate is not None:  # token s fades from s + w: the gates after s + w up to the last token
        tp = log_gate.shape[-1]
        upto = torch.where((torch.arange(tp, device=dev)[None, :] <= last[:, None])[:, None], log_gate, 0.0)
        after = F.pad(upto.flip(-1).cumsum(-1).flip(-1), (0, w + 1))[..., w + 1:]  # [B, Hk, Tp]
        folded = folded * after.exp()[..., None]
        c_fade = torch.where(c_valid, after.gather(2, c_pos), torch.zeros((), dtype=after.dtype, device=dev))
    lin = (ff * folded).transpose(-1, -2) @ _augment(vv, True)
    # window token u sits at rolled position t - n + u - shift; it leaves during this epoch when
    # that position is in chunk c - 1, where it is candidate S + j
    nwin = window.keys.shape[2]
    j = t - nwin + torch.arange(nwin, device=dev)[None, :] - shift[:, None] - (c[:, None] - 1) * w  # [B, n]
    scores = at(pri)[..., cap:].gather(2, j.clamp(0, w - 1)[:, None, :].expand(b, n_kv, nwin))
    scores = torch.where(((j >= 0) & (j < w))[:, None], scores, torch.zeros_like(scores))
    cpos = (c_pos - (first - shift)[:, None, None]) * c_valid  # from each sequence's origin
    count = torch.where(has, t - first, torch.zeros_like(first))
    return SparseHybridState(window.keys, window.key_features, window.values, window.valid, scores,
                             lin.unsqueeze(2), _take(kk, c_pos).to(k.dtype), _take(ff, c_pos).to(kf.dtype),
                             _take(vv, c_pos).to(v.dtype), c_valid, c_pri, cpos, count, c_fade)
