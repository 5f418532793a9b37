"""The sparse cache's selection (``ops/hybrid/__init__.py`` has the sparse hybrid's output): which
tokens leaving the window are kept exactly and which are folded into the linear state, and when.

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

Here: the priorities (``priorities``: ``recall_error``, ``value_novelty`` or the position), the
eviction's lowest-ranked candidate (``_lowest``, a step's) and a step's rescoring at a boundary
(``_rescored``), and the chunked form's decisions over a whole sequence (``_select``; in closed form
under ``priority="first"`` without gates, ``_select_first``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear_attention import _augment, accum_dtype
from .state import RingSparseState


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
