"""The LoLCATs hybrid's PyTorch sequence forms (``ops/hybrid/__init__.py`` has the math), linear in
the length: chunks of ``w`` tokens, each chunk's queries seeing the keys of their own chunk and the
one before exactly and the linear state of older chunks as a running sum.

``hybrid_attention_chunked`` (its Triton twin: ``chunk_triton.py``) and
``sparse_hybrid_attention_chunked``, one selection epoch a chunk: a loop over chunks decides the
cache (``sparse_select.py``), everything inside a chunk is batched. The sparse form counts epochs
from each sequence's own origin (a left-padded batch decides exactly as each sequence alone): it
rolls each sequence left by ``p mod w`` so that every origin falls on a chunk boundary.

Both give the decoding state after the prompt (``output_final_state``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear_attention import _augment, _group, accum_dtype
from .shared import _mix_shape, _mixed, _normalise, _real_keys, _scores
from .sparse_select import _check, _fades_at_end, _select, _select_first, _take
from .state import HybridState, SparseHybridState, hybrid_final_state


def hybrid_attention_chunked(
    q, k, qf, kf, v, gamma, *, window: int, scale: float, softcap: float | None = None,
    output_final_state: bool = False, key_mask: torch.Tensor | None = None, log_gate: torch.Tensor | None = None,
    mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, HybridState | None]:
    """Linear-time form with chunks of ``window`` tokens.

    Queries of chunk c see keys of chunks c-1 and c (their window and the youngest linear keys,
    masked exactly) and the linear state of chunks <= c-2, a running sum. With gates: query ``i`` of
    chunk c weighs key ``j`` of chunk c-1 (older than its window when ``j <= i``) by
    ``exp(G_c[i] - G_c[j])`` (``G_c`` the log gates' cumulative sum within chunk c), and the state
    ``E_c`` of chunks <= c-2, taken at the end of chunk c-1, by ``exp(G_c[i])``; ``E_{c+1} =
    exp(G_c[-1]) E_c + P_{c-1}``, where ``P_m`` sums chunk m's keys each faded to the end of chunk m+1.
    Sums within a chunk stay small, so long sequences lose no precision to a long cumulative sum.
    """
    acc = accum_dtype(q.dtype)
    b, n_kv, t, d = k.shape
    w = window
    kf, v = _real_keys(key_mask, kf, v)
    n = -(-t // w)
    pad = n * w - t
    pad_t = lambda x, front: torch.nn.functional.pad(x, (0, 0, front, pad))  # noqa: E731
    qg = pad_t(_group(q, n_kv).to(acc), 0).unflatten(3, (n, w))  # [B, Hk, G, N, w, D]
    qfg = pad_t(_group(qf, n_kv).to(acc), 0).unflatten(3, (n, w))
    # Keys/values with one chunk of zeros in front, then overlapping pairs of chunks (c-1, c).
    pairs = lambda x: pad_t(x.to(acc), w).unfold(2, 2 * w, w).transpose(-1, -2).unsqueeze(2)  # noqa: E731
    k2, kf2, v2 = pairs(k), pairs(kf), pairs(v)  # [B, Hk, 1, N, 2w, *]
    g = gamma.to(acc).reshape(n_kv, -1)[..., None, None, None]  # [Hk, G, 1, 1, 1]

    i = torch.arange(w, device=q.device)[:, None]
    j = torch.arange(2 * w, device=q.device)[None, :]
    chunk = torch.arange(n, device=q.device)[:, None, None]
    # Query i of chunk c is t = c*w + i; key j of the pair is s = (c-1)*w + j; t - s = w + i - j.
    in_window = (j > i) & (j <= i + w) & ((chunk > 0) | (j >= w))  # [N, w, 2w]
    older = j <= i  # t - s >= w; in chunk 0 these keys are zero padding
    if key_mask is not None:  # real keys of each pair of chunks: [B, 1, 1, N, 1, 2w]
        real = torch.nn.functional.pad(key_mask, (w, pad)).unfold(1, 2 * w, w)
        in_window = in_window & real[:, None, None, :, None, :]

    scores = _scores(qg, k2, scale, softcap)  # [B, Hk, G, N, w, 2w]
    neg = torch.finfo(scores.dtype).min
    scores = scores.masked_fill(~in_window, neg)
    c = scores.amax(dim=-1, keepdim=True)
    linear = (qfg @ kf2.transpose(-1, -2)) * older
    kfc = pad_t(kf.to(acc), 0).unflatten(2, (n, w)).unsqueeze(2)
    vc = _augment(pad_t(v.to(acc), 0), True).unflatten(2, (n, w)).unsqueeze(2)
    v2a = _augment(v2, True)
    window_terms = g * torch.exp(scores - c) * in_window
    if log_gate is None:
        # numerators and (last column) denominator
        out = (window_terms + linear) @ v2a if mix is None else linear @ v2a
        # Linear state of chunks <= c-2: exclusive running sum of per-chunk sums, shifted by one more chunk.
        per_chunk = kfc.transpose(-1, -2) @ vc  # [B, Hk, 1, N, F, D+1]
        before = torch.cumsum(per_chunk, dim=3) - per_chunk  # state before chunk c
        older_state = torch.cat([torch.zeros_like(before[:, :, :, :1]), before[:, :, :, :-1]], dim=3)
        out = out + qfg @ older_state
    else:
        cum = torch.nn.functional.pad(log_gate.to(acc), (0, pad)).unflatten(2, (n, w)).cumsum(-1)  # [B, Hk, N, w]
        lower = torch.ones(w, w, dtype=torch.bool, device=q.device).tril()
        diff = cum[..., :, None] - cum[..., None, :]
        fade = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # [B, Hk, N, w, w]
        fade = torch.nn.functional.pad(fade, (0, w)).unsqueeze(2)  # keys of chunk c-1 only
        out = (window_terms + linear * fade) @ v2a if mix is None else (linear * fade) @ v2a
        # P_m: chunk m's keys faded to the end of chunk m + 1 (m = 0 .. N-2)
        to_end = (cum[..., 1:, -1:] - cum[..., 1:, :]).exp().unsqueeze(2)[..., None]  # [B, Hk, 1, N-1, w, 1]
        parts = (kfc[:, :, :, :-1] * to_end).transpose(-1, -2) @ vc[:, :, :, :-1]  # [B, Hk, 1, N-1, F, D+1]
        chunk_fade = cum[..., -1].exp()[:, :, None, :, None, None]  # [B, Hk, 1, N, 1, 1]
        states = [kfc.new_zeros(b, n_kv, 1, 1, kfc.shape[-1], d + 1)] * min(n, 2)
        for i in range(1, n - 1):
            states.append(chunk_fade[:, :, :, i : i + 1] * states[-1] + parts[:, :, :, i - 1 : i])
        older_state = torch.cat(states, dim=3)
        out = out + (qfg * cum.exp().unsqueeze(2)[..., None]) @ older_state

    if mix is None:  # ``out`` holds every term
        y = _normalise(out[..., :-1], out[..., -1:])
    else:
        y = _mixed(window_terms @ v2a, out, _mix_shape(mix, n_kv, 3, acc))
    y = y.flatten(3, 4)[..., :t, :].reshape(b, -1, t, d).to(q.dtype)
    state = hybrid_final_state(k, kf, v, window, key_mask, log_gate=log_gate) if output_final_state else None
    return y, state


def _roll_left(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, T, *]`` with sequence b read at positions ``idx[b]`` ``[B, T]``."""
    return x.gather(2, idx[:, None, :, None].expand(x.shape[0], x.shape[1], -1, x.shape[3]))


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
