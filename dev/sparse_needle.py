"""Does the sparse exact cache keep the passkey needle? (issue #21; a diagnosis, CPU-sized.)

For a LoLCATs checkpoint with ``sparse_cache = S``, build the recall task's passkey prompts
(``eval.tasks.passkey.make_trial``), run one forward pass over each prompt and record, per layer, the
inputs of ``ops.sparse_hybrid_attention_chunked`` (post-RoPE q/k, their features, v) and the keys
before RoPE. The op's results are not changed: the recording wrapper calls the op as the model
would, and once more with ``output_final_state=True`` for the cache the prompt leaves behind.

Offline, ``simulate`` replays the cache's selection (the rule of ``ops/sparse_hybrid_attention.py``:
epochs of ``w`` tokens; at each boundary the cache and the epoch's leavers get a priority against
the linear state of the folded tokens; the top ``S`` stay) with a pluggable priority, so other rules
can be compared on the same recorded k/v. With the op's own rule it must reproduce the op's final
cache exactly (checked for every prompt: ``check``). Recorded k/v come from a model running the op's
rule (or the rule selected with ``--rule`` when the op has it); a different rule would change the
later layers' inputs a little, so offline numbers for other rules are an approximation.

Reported per rule: needle retention (the fraction of layer x key-head caches that hold every digit
token of the key at the end of the prompt; only prompts whose needle has left the window), the
needle digits' priority rank among the candidates at each boundary, and what the caches hold.

    PYTHONPATH=src python dev/sparse_needle.py CHECKPOINT --sparse-cache 256 --lengths 512,1024
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

import linearize
from linearize import ops
from linearize.eval.tasks import passkey
from linearize.mixers.lolcats import LolcatsAttention


# ----------------------------------------------------------------------------- recording


@contextmanager
def recording(model):
    """Record, per LoLCATs layer, what the sparse op sees: ``rec[layer] = dict(q, k, qf, kf, v, k_pre,
    gamma, cache_pos, cache_valid)`` (batch 1; tensors on the CPU, float32)."""
    rec: dict[int, dict] = {}
    current = {}
    orig_op = ops.sparse_hybrid_attention_chunked
    orig_inputs = LolcatsAttention._inputs

    def inputs(self, q, k, position_embeddings):
        current["layer"] = self.layer_idx
        current["k_pre"] = k.detach().float().cpu()
        return orig_inputs(self, q, k, position_embeddings)

    def op(q, k, qf, kf, v, gamma, **kw):
        want = kw.pop("output_final_state", False)
        y, state = orig_op(q, k, qf, kf, v, gamma, **kw, output_final_state=True)
        layer = current["layer"]
        rec[layer] = dict(q=q.detach().float().cpu(), k=k.detach().float().cpu(), qf=qf.detach().float().cpu(),
                          kf=kf.detach().float().cpu(), v=v.detach().float().cpu(), k_pre=current["k_pre"],
                          gamma=gamma.detach().float().cpu(), cache_pos=state.cache_pos.cpu(),
                          cache_valid=state.cache_valid.cpu(), scale=kw["scale"], softcap=kw.get("softcap"))
        return y, (state if want else None)

    ops.sparse_hybrid_attention_chunked = op
    LolcatsAttention._inputs = inputs
    try:
        yield rec
    finally:
        ops.sparse_hybrid_attention_chunked = orig_op
        LolcatsAttention._inputs = orig_inputs


def needle_positions(tok, trial) -> list[int]:
    """Token positions of the key's digits in the trial's prompt."""
    enc = tok(trial.prompt, return_offsets_mapping=True)
    assert enc.input_ids == trial.ids
    start = trial.prompt.index(trial.answer)
    end = start + len(trial.answer)
    return [i for i, (a, b) in enumerate(enc.offset_mapping) if a < end and b > start and b > a]


# ----------------------------------------------------------------------------- priorities


def readout_error(f, v, num, den):
    """``||v - f num / f.den||`` per candidate (0 readout where ``f.den`` is 0): f ``[Hk, M, F]``, v
    ``[Hk, M, D]``, num ``[Hk, F, D]``, den ``[Hk, F]``."""
    d = (f @ den[..., None])
    read = (f @ num) / d.clamp_min(torch.finfo(d.dtype).tiny)
    return (v - read).norm(dim=-1)


class Rule:
    """A priority rule: ``priority(L, pos, folded, before)`` with ``L`` the layer's recorded tensors
    (float64), ``pos`` ``[Hk, M]`` the candidates, ``folded`` ``[Hk, T]`` bool (the tokens in the
    linear state at the boundary), ``before`` the boundary's position. ``sinks``: the first tokens
    always kept (outside the ranking)."""

    sinks = 0

    def __init__(self, name):
        self.name = name

    def priority(self, L, pos, folded, before):
        raise NotImplementedError


def _take(x, pos):
    return x.gather(1, pos[..., None].expand(-1, -1, x.shape[-1]))


class SelfRecall(Rule):
    """LoLA's self-recall error against the folded tokens' state (the op's rule), with options:
    ``feat`` which features ("kf": the key map of post-RoPE keys, the op's; "kf_pre": the key map of
    keys before RoPE, in the readout and in a shadow state; "qf": the group's query maps applied to
    the key, error averaged over the group), ``state`` which tokens form the state ("folded": the
    op's; "all": every token before the boundary, the candidate itself included), ``norm`` (divide
    by ||v||) and ``sinks``."""

    def __init__(self, name, feat="kf", state="folded", norm=False, sinks=0):
        super().__init__(name)
        self.feat, self.state, self.norm, self.sinks = feat, state, norm, sinks

    def priority(self, L, pos, folded, before):
        v = L["v"]
        t = v.shape[1]
        mask = folded if self.state == "folded" else (torch.arange(t) < before).expand_as(folded)
        m = mask.to(v.dtype)[..., None]
        if self.feat == "qf":
            errs = []
            for f in L["kf_as_q"]:  # [Hk, T, F] per group member
                num, den = (f * m).transpose(-1, -2) @ v, (f * m).sum(1)
                errs.append(readout_error(_take(f, pos), _take(v, pos), num, den))
            err = torch.stack(errs).mean(0)
        else:
            f = L["kf"] if self.feat == "kf" else L["kf_pre"]
            num, den = (f * m).transpose(-1, -2) @ v, (f * m).sum(1)
            err = readout_error(_take(f, pos), _take(v, pos), num, den)
        if self.norm:
            err = err / _take(v, pos).norm(dim=-1).clamp_min(1e-12)
        return err


class Fn(Rule):
    """A priority from a function of the candidates alone."""

    def __init__(self, name, fn, sinks=0):
        super().__init__(name)
        self.fn, self.sinks = fn, sinks

    def priority(self, L, pos, folded, before):
        return self.fn(L, pos, folded, before)


def _novelty(L, pos, folded, before, key="k_pre"):
    """Key novelty: minus the largest cosine similarity of the candidate's key to any token before the
    boundary other than itself (a token seen before in a similar form scores low)."""
    k = L[key]
    kn = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    c = _take(kn, pos)  # [Hk, M, D]
    sim = c @ kn.transpose(-1, -2)  # [Hk, M, T]
    t = k.shape[1]
    ok = (torch.arange(t) < before)[None, None, :] & (torch.arange(t)[None, None, :] != pos[..., None])
    return -sim.masked_fill(~ok, -2.0).amax(-1)


def _density(L, pos, folded, before, normalise=False):
    """Minus the candidate's kernel mass on the folded tokens, ``phi_k(k_x) . z`` (the readout's
    denominator): a key like many folded ones scores low. ``normalise``: divided by ``phi_k(k_x) .
    phi_k(k_x)``."""
    f = L["kf"]
    den = (f * folded.to(f.dtype)[..., None]).sum(1)  # [Hk, F]
    fx = _take(f, pos)
    d = (fx @ den[..., None])[..., 0]
    if normalise:
        d = d / (fx * fx).sum(-1)
    return -d


def _novelty_folded(L, pos, folded, before, key="k_pre"):
    """Key novelty against the folded tokens only (minus the largest cosine similarity)."""
    k = L[key]
    kn = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    sim = _take(kn, pos) @ kn.transpose(-1, -2)
    return -sim.masked_fill(~folded[:, None, :], -2.0).amax(-1)


class Variant(Rule):
    """``rule`` with the output rule or cache size changed, for the end-to-end runs: ``absolute``
    weighs window and cache tokens gamma exp(s) instead of gamma exp(s - c) (c the largest score
    over window and cache), as LoLA's flash-attention inference does (its softmax numerator and
    denominator come from flash's log-sum-exp, not max-subtracted); ``window_max`` takes c as the
    largest score over the window alone (cached tokens on the window's scale, the linear terms on the
    scale the hybrid was trained at); ``cap`` overrides the cache size."""

    def __init__(self, name, rule, absolute=False, cap=None, window_max=False):
        super().__init__(name)
        self.rule, self.absolute, self.cap, self.sinks = rule, absolute, cap, rule.sinks
        self.window_max = window_max

    def priority(self, L, pos, folded, before):
        return self.rule.priority(L, pos, folded, before)


def _novelty_cand(L, pos, folded, before, key="k_pre"):
    """Novelty among the candidates: minus the largest cosine similarity of the candidate's ``key``
    (a recorded tensor: "k_pre", "k" or "v") to any other candidate (the cache and the epoch's
    leavers, all held exactly at the boundary: constant memory)."""
    x = _take(L[key], pos)
    xn = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    sim = xn @ xn.transpose(-1, -2)
    eye = torch.eye(pos.shape[1], dtype=torch.bool)
    return -sim.masked_fill(eye, -2.0).amax(-1)


def rules(w):
    g = torch.Generator().manual_seed(0)
    return [
        SelfRecall("A self-recall (op)"),
        SelfRecall("B self-recall / ||v||", norm=True),
        SelfRecall("C self-recall vs all tokens", state="all"),
        SelfRecall("D self-recall + 4 sinks", sinks=4),
        SelfRecall("E self-recall, pre-RoPE key map", feat="kf_pre"),
        SelfRecall("E2 pre-RoPE / ||v||", feat="kf_pre", norm=True),
        SelfRecall("F self-recall, query maps", feat="qf"),
        Fn("G ||v||", lambda L, pos, f, b: _take(L["v"], pos).norm(dim=-1)),
        Fn("H key novelty (pre-RoPE cosine)", _novelty),
        Fn("H2 key novelty (post-RoPE cosine)", lambda L, pos, f, b: _novelty(L, pos, f, b, key="k")),
        Fn("H3 key novelty vs folded (pre-RoPE)", _novelty_folded),
        Fn("H5 key novelty among candidates (pre-RoPE)", _novelty_cand),
        Fn("H6 key novelty among candidates (post-RoPE)", lambda L, pos, f, b: _novelty_cand(L, pos, f, b, key="k")),
        Fn("N value novelty (all before)", lambda L, pos, f, b: _novelty(L, pos, f, b, key="v")),
        Fn("N5 value novelty among candidates", lambda L, pos, f, b: _novelty_cand(L, pos, f, b, key="v")),
        Fn("AN5 self-recall x (1 - value similarity)", lambda L, pos, f, b: SelfRecall("").priority(L, pos, f, b)
           * (1 + _novelty_cand(L, pos, f, b, key="v"))),
        Fn("K low density -phi(k).z", _density),
        Fn("K2 low density / phi(k).phi(k)", lambda L, pos, f, b: _density(L, pos, f, b, normalise=True)),
        Fn("I recent (FIFO)", lambda L, pos, f, b: pos.to(torch.float64)),
        Fn("J random", lambda L, pos, f, b: torch.rand(pos.shape, generator=g, dtype=torch.float64)),
    ]


# ----------------------------------------------------------------------------- the selection, replayed


def simulate(L, w, cap, rule, at, watch=()):
    """The cache under ``rule`` as the queries at times ``at`` see it: ``(caches, ranks)`` with
    ``caches[t]`` ``[Hk, T]`` bool (after time t's eviction) and ``ranks[m]`` ``[Hk, len(watch)]`` each
    watched position's rank (1 = highest priority) among the candidates of epoch m (0 where it is no
    candidate). Epoch m (boundary ``b = m w``): the candidates are the cache at ``b`` and the leavers
    ``b - w .. b - 1`` (token s leaves at time ``s + w``); at each time the top ``S`` of those arrived
    so far (priority, then the younger) are cached, the rest folded; the first ``rule.sinks`` tokens
    never compete and take sink slots of the cache."""
    v = L["v"]
    n_kv, t_all = v.shape[:2]
    t_end = max(at)
    sinks = min(rule.sinks, cap)
    room = cap - sinks
    pos_all = torch.arange(t_all)
    cache = torch.zeros(n_kv, t_all, dtype=torch.bool)
    folded = torch.zeros(n_kv, t_all, dtype=torch.bool)
    caches = {t: torch.zeros(n_kv, t_all, dtype=torch.bool) for t in at if t < w}
    ranks = []
    m = 1
    while m * w <= t_end:
        b = m * w
        leavers = (pos_all >= b - w) & (pos_all <= min(b - 1, t_end - w))
        cand = (cache | leavers[None]) & (pos_all >= sinks)[None]
        pos = torch.stack([torch.nonzero(c).flatten() for c in cand])  # the same count in every head
        pri = rule.priority(L, pos, folded, b)
        # best first: priority descending, ties to the younger (higher position)
        order = torch.argsort(pos, dim=-1, descending=True, stable=True)
        order = order.gather(1, torch.argsort(pri.gather(1, order), dim=-1, descending=True, stable=True))
        ranked = pos.gather(1, order)  # [Hk, M]
        r = torch.zeros(n_kv, len(watch), dtype=torch.long)
        for j, p in enumerate(watch):
            hit = ranked == p
            r[:, j] = torch.where(hit.any(1), hit.long().argmax(1) + 1, 0)
        ranks.append(r)
        for t in at:
            if b <= t < b + w:
                arrived = cache | (leavers & (pos_all <= t - w))[None]
                ok = arrived.gather(1, ranked)
                top = ok & (ok.long().cumsum(1) <= room)
                now = torch.zeros_like(cache)
                now.scatter_(1, ranked, top)
                caches[t] = now | (arrived & (pos_all < sinks)[None])
        if b + w <= t_end:  # the epoch is complete: its cache for the next one, the rest folded
            new = torch.zeros_like(cache)
            new.scatter_(1, ranked[:, :room], True)
            folded |= cand & ~new
            cache = new | ((cache | leavers[None]) & (pos_all < sinks)[None])
        m += 1
    return caches, ranks


def check(rec, w, cap):
    """The replay of the op's rule against the op's own final caches: the number of layer x head caches
    that differ (0 expected)."""
    bad = 0
    rule = SelfRecall("op")
    for layer, L in rec.items():
        t = L["v"].shape[2]
        cache = simulate(_prepared(L), w, cap, rule, at=[t - 1])[0][t - 1]
        pos, valid = L["cache_pos"][0], L["cache_valid"][0]
        for h in range(cache.shape[0]):
            real = set(pos[h][valid[h]].tolist())
            sim = set(torch.nonzero(cache[h]).flatten().tolist())
            bad += real != sim
    return bad


def _prepared(L, fmk=None, fmq=None):
    """The recorded tensors of one layer as float64 ``[Hk, T, *]`` (batch 1), with the pre-RoPE key
    features and the key as seen by the query maps when the maps are given."""
    if "_p" in L:
        return L["_p"]
    p = {name: L[name][0].double() for name in ("q", "qf", "k", "kf", "v", "k_pre")}
    p["gamma"], p["scale"], p["softcap"] = L["gamma"].double(), L["scale"], L["softcap"]
    L["_p"] = p
    return p


def add_features(L, mixer):
    """Pre-RoPE key features (the layer's key map on the keys before RoPE) and the post-RoPE key
    through each query map of the key head's group (``kf_as_q``: a list of ``[Hk, T, F]``)."""
    p = _prepared(L)
    with torch.no_grad():
        p["kf_pre"] = mixer.feature_map_k(L["k_pre"]).double()[0]
        n_kv = p["k"].shape[0]
        group = L["q"].shape[1] // n_kv
        kq = L["k"].repeat_interleave(group, dim=1)  # [1, H, T, D]
        fq = mixer.feature_map_q(kq)[0].double()  # [H, T, F]
        p["kf_as_q"] = [fq[g::group] for g in range(group)]


# ----------------------------------------------------------------------------- the last query's attention


def needle_mass(L, w, cache, t, target):
    """Attention mass on token ``target`` at the query at time ``t``, per query head: ``(full,
    hybrid)`` ``[H]`` each. ``full``: softmax over every token up to t (the recorded q/k, i.e. the
    student's projections, with the softmax the teacher uses); ``hybrid``: the student's output rule
    with ``cache`` ``[Hk, T]`` (gamma exp(s - c) over window and cache, c their largest score, and
    phi_q(q) . phi_k(k) over the folded rest, one normaliser)."""
    q, qf = L["q"][:, t], L["qf"][:, t]  # [H, D], [H, F]
    k, kf = L["k"][:, : t + 1], L["kf"][:, : t + 1]  # [Hk, t + 1, *]
    n_q, n_kv = q.shape[0], k.shape[0]
    grp = n_q // n_kv
    kk, ff = k.repeat_interleave(grp, 0), kf.repeat_interleave(grp, 0)  # [H, t + 1, *]
    s = (kk @ q[:, :, None])[..., 0] * L["scale"]
    if L["softcap"]:
        s = L["softcap"] * torch.tanh(s / L["softcap"])
    full = torch.softmax(s, -1)
    pos = torch.arange(t + 1)
    soft = (pos > t - w)[None] | cache[:, : t + 1].repeat_interleave(grp, 0)
    c = s.masked_fill(~soft, -math.inf).amax(-1, keepdim=True)
    a = torch.where(soft, L["gamma"][:, None] * torch.exp(s - c), (ff @ qf[:, :, None])[..., 0])
    hyb = a / a.sum(-1, keepdim=True)
    return full[:, target], hyb[:, target]


# ----------------------------------------------------------------------------- end to end


def hybrid_with_rule(q, k, qf, kf, v, gamma, *, scale, softcap, window, cache_size, rule, extra):
    """The op's output (batch 1, no padding) with the cache chosen by ``rule`` (``simulate`` at every
    query time): gamma exp(s - c) over window and cache, phi_q . phi_k over the folded rest, one
    normaliser. ``extra``: the layer's other tensors for the rule (``k_pre``, ``kf_pre``)."""
    dt = torch.float64
    L = {"k": k[0].to(dt), "kf": kf[0].to(dt), "v": v[0].to(dt), **extra}
    t = k.shape[2]
    if getattr(rule, "cap", None) is not None:
        cache_size = rule.cap
    caches = simulate(L, window, cache_size, rule, at=list(range(t)))[0]
    cached = torch.stack([caches[i] for i in range(t)], 1)  # [Hk, T(query), T(key)]
    grp = q.shape[1] // k.shape[1]
    qq, qqf = q[0].to(dt), qf[0].to(dt)
    kk, ff, vv = (x.repeat_interleave(grp, 0) for x in (L["k"], L["kf"], L["v"]))
    s = qq @ kk.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    causal = j <= i
    soft = ((j > i - window) & causal)[None] | cached.repeat_interleave(grp, 0)
    c = s.masked_fill(~soft, -math.inf).amax(-1, keepdim=True)
    lin = qqf @ ff.transpose(-1, -2)
    if getattr(rule, "absolute", False):  # gamma exp(s) against phi . phi: the linear terms scaled by exp(-c)
        lin = lin * torch.exp(-c)
    elif getattr(rule, "window_max", False):  # gamma exp(s - c_w): the linear terms scaled by exp(c_w - c)
        c_w = s.masked_fill(~((j > i - window) & causal)[None], -math.inf).amax(-1, keepdim=True)
        lin = lin * torch.exp(c_w - c)
    a = torch.where(soft, gamma.to(dt)[:, None, None] * torch.exp(s - c), torch.where(causal, lin, 0))
    y = (a @ vv) / a.sum(-1, keepdim=True)
    return y[None].to(q.dtype)


@contextmanager
def rule_in_op(model, rule):
    """The model's sparse op replaced by ``hybrid_with_rule`` with ``rule`` (``rule=None``: the op)."""
    if rule is None:
        yield
        return
    orig_op = ops.sparse_hybrid_attention_chunked
    orig_inputs = LolcatsAttention._inputs
    current = {}

    def inputs(self, q, k, position_embeddings):
        with torch.no_grad():
            current["extra"] = {"k_pre": k[0].double(), "kf_pre": self.feature_map_k(k)[0].double()}
        return orig_inputs(self, q, k, position_embeddings)

    def op(q, k, qf, kf, v, gamma, *, window, cache_size, scale, softcap=None, output_final_state=False,
           key_mask=None, priority=None):  # the rule decides, not the spec's sparse_priority
        assert q.shape[0] == 1 and (key_mask is None or bool(key_mask.all())) and not output_final_state
        return hybrid_with_rule(q, k, qf, kf, v, gamma, scale=scale, softcap=softcap, window=window,
                                cache_size=cache_size, rule=rule, extra=current["extra"]), None

    ops.sparse_hybrid_attention_chunked = op
    LolcatsAttention._inputs = inputs
    try:
        yield
    finally:
        ops.sparse_hybrid_attention_chunked = orig_op
        LolcatsAttention._inputs = orig_inputs


def answer_score(model, tok, trial, rule=None):
    """Teacher-forced answer of the student with the cache chosen by ``rule`` (None: the op):
    ``(exact, digits_right, logprob)``. ``exact``: greedy decoding would answer with the key (each of
    " " and the digits is the argmax after the right prefix, and the token after is no digit);
    ``digits_right``: how many of the 5 digit tokens are the argmax; ``logprob``: the answer tokens'
    summed log-probability."""
    answer = tok(" " + trial.answer, add_special_tokens=False).input_ids
    p = len(trial.ids)
    ids = torch.tensor([trial.ids + answer])
    with rule_in_op(model, rule), torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, p - 1 :].double()
    guess = logits.argmax(-1).tolist()
    after = tok.convert_ids_to_tokens(guess[-1])
    exact = guess[:-1] == answer and not any(ch.isdigit() for ch in after)
    logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(answer)[:, None]).sum().item()
    right = sum(g == a for g, a in zip(guess[1:-1], answer[1:]))
    return exact, right, round(logp, 3)


# ----------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--sparse-cache", type=int, default=256)
    ap.add_argument("--lengths", default="512,1024")
    ap.add_argument("--depths", default="0,25,50,75")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--rules", default=None, help="comma-separated rule letters (default: all)")
    ap.add_argument("--out", default=None, help="write the measurements as JSON here")
    ap.add_argument("--records", type=Path, default=None, help="keep (and reuse) each prompt's recording here")
    ap.add_argument("--absolute", action="store_true",
                    help="end to end: also each rule (and no cache) with LoLA's absolute softmax weights")
    ap.add_argument("--window-max", action="store_true",
                    help="end to end: also each rule with c the window's largest score (not window and cache)")
    ap.add_argument("--end-to-end", action="store_true",
                    help="instead: the student's teacher-forced answer with each rule's cache (the model run "
                         "with the rule), beside no cache, the op, and everything exact")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tok = linearize.load(a.checkpoint, device="cpu")
    # the op's rule is rule A (self-recall), whatever the checkpoint's sparse_priority: the replay check needs it
    linearize.respec(model, sparse_cache=a.sparse_cache, sparse_priority="recall")
    model.eval()
    mixers = {m.layer_idx: m for m in linearize.mixers(model).values()}
    w = next(iter(mixers.values())).spec.window
    cap = a.sparse_cache
    all_rules = rules(w)
    if a.rules:
        want = a.rules.split(",")
        all_rules = sorted((r for r in all_rules if r.name.split()[0] in want), key=lambda r: want.index(r.name.split()[0]))
    results = []
    for length in (int(x) for x in a.lengths.split(",")):
        for depth in (int(x) for x in a.depths.split(",")):
            for i in range(a.trials):
                trial = passkey.make_trial(tok, length, length, depth, i, a.seed)
                if a.end_to_end:
                    extra = []
                    if a.window_max:
                        extra += [Variant(r.name + ", window max", r, window_max=True) for r in all_rules]
                    if a.absolute:
                        extra += [Variant("no cache, absolute", all_rules[0], absolute=True, cap=0)]
                        extra += [Variant(r.name + ", absolute", r, absolute=True) for r in all_rules]
                    results.append(run_end_to_end(model, tok, trial, all_rules + extra, cap))
                else:
                    results.append(run_trial(model, tok, mixers, trial, all_rules, w, cap, a.records))
    if a.end_to_end:
        names = list(results[0]["scores"])
        print("\nteacher-forced exact / digits right / summed log-prob of the answer, per length:")
        for length in sorted({r["length"] for r in results}):
            rows = [r for r in results if r["length"] == length]
            for name in names:
                sc = [r["scores"][name] for r in rows]
                print(f"  {length:>5} {name:<34} exact {sum(x[0] for x in sc)}/{len(sc)}  "
                      f"digits {sum(x[1] for x in sc)}/{5 * len(sc)}  logp {sum(x[2] for x in sc) / len(sc):.2f}")
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(dict(args=vars(a), results=results), fh, indent=1)
        return
    summary = _summary(results)
    print("\nneedle retention (all digits), prompts with the needle outside the window:")
    for name, by_len in summary.items():
        print(f"  {name:<36} " + "  ".join(f"{ln}: {v:.3f}" for ln, v in by_len.items()))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(args=vars(a), results=results, summary=summary), fh, indent=1)


def run_trial(model, tok, mixers, trial, all_rules, w, cap, records=None):
    """One prompt, teacher-forced with its answer: the prompt, then " " and the key's digits (P + 6
    tokens). The queries at P .. P + 4 (the space and the first four digits) predict the digits; the
    student answers right under greedy decoding when every one of the 6 answer tokens is its argmax
    and the token after is no digit (``teacher_forced_exact``; the model runs the op's rule). Per
    rule: the needle's retention in the cache the query at P sees, and the mean attention mass the
    query at P + j puts on digit j under the rule's cache at P + j, over the heads where full
    softmax puts at least 0.2 on it (``finding`` heads). ``records``: a folder keeping each prompt's
    recording (the forward pass is skipped when it holds one)."""
    needle = needle_positions(tok, trial)
    answer = tok(" " + trial.answer, add_special_tokens=False).input_ids
    p = len(trial.ids)
    ids = torch.tensor([trial.ids + answer])
    saved = records / f"passkey_{trial.length}_{trial.depth}_{trial.index}_S{cap}.pt" if records else None
    if saved is not None and saved.exists():
        rec, guess = torch.load(saved)
    else:
        with recording(model) as rec, torch.no_grad():
            logits = model(ids, use_cache=False).logits[0]
        guess = logits[p - 1 :].argmax(-1).tolist()  # predictions of tokens p .. end, then the one after
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            torch.save((rec, guess), saved)
    after = tok.convert_ids_to_tokens(guess[-1])
    exact = guess[:-1] == answer and not any(ch.isdigit() for ch in after)
    mismatched = check(rec, w, cap)
    for layer, L in rec.items():
        add_features(L, mixers[layer])
    queries = [p + j for j in range(len(needle))]  # query p + j predicts digit j
    row = dict(length=trial.length, depth=trial.depth, trial=trial.index, tokens=p, needle=needle,
               in_window=min(needle) >= p - w, teacher_forced_exact=exact, replay_mismatches=mismatched, rules={})
    # selection aside: the needle's attention mass with no cache and with the needle forced into the op's cache
    finding, full_m, none_m, forced_m = {}, [], [], []
    for layer, L in sorted(rec.items()):
        P = _prepared(L)
        caches = simulate(P, w, cap, all_rules[0], at=queries)[0]
        for j, q in enumerate(queries):
            cache = caches[q]
            full, nocache = needle_mass(P, w, cache & False, q, needle[j])
            forced = cache.clone()
            forced[:, needle[j]] = True
            heads = full >= 0.2
            finding[layer, j] = heads
            full_m += full[heads].tolist()
            none_m += nocache[heads].tolist()
            forced_m += needle_mass(P, w, forced, q, needle[j])[1][heads].tolist()
    row.update(finding_heads=len(full_m), mass_full=_mean(full_m), mass_no_cache=_mean(none_m),
               mass_needle_forced=_mean(forced_m))
    print(json.dumps({k: row[k] for k in ("length", "depth", "trial", "tokens", "in_window", "teacher_forced_exact",
                                           "replay_mismatches", "finding_heads", "mass_full", "mass_no_cache",
                                           "mass_needle_forced")}), flush=True)
    for rule in all_rules:
        held_all, held_any, first_ranks, contents, n, masses = 0, 0, [], Counter(), 0, []
        for layer, L in sorted(rec.items()):
            P = _prepared(L)
            caches, ranks = simulate(P, w, cap, rule, at=queries, watch=needle)
            for j, q in enumerate(queries):
                masses += needle_mass(P, w, caches[q], q, needle[j])[1][finding[layer, j]].tolist()
            cache = caches[p]
            has = cache[:, needle]  # [Hk, digits]
            held_all += int(has.all(1).sum())
            held_any += int(has.any(1).sum())
            n += cache.shape[0]
            competing = [r for r in ranks if bool((r > 0).any())]  # the epochs the needle competes in
            if competing:
                first_ranks.append((competing[0].float().median().item(), competing[-1].float().median().item()))
            for h in range(cache.shape[0]):
                for pos in torch.nonzero(cache[h]).flatten().tolist():
                    contents[_kind(tok, trial.ids, pos, needle)] += 1
        total = sum(contents.values()) or 1
        r = row["rules"][rule.name] = dict(
            all_digits=held_all / n, any_digit=held_any / n, mass=_mean(masses),
            rank_first=_median([x[0] for x in first_ranks]), rank_last=_median([x[1] for x in first_ranks]),
            contents={k: round(c / total, 3) for k, c in contents.most_common()})
        print(f"   {rule.name:<34} all={r['all_digits']:.3f} any={r['any_digit']:.3f} mass={r['mass']} "
              f"rank first/last={r['rank_first']}/{r['rank_last']} {dict(list(r['contents'].items())[:5])}", flush=True)
    return row


def run_end_to_end(model, tok, trial, all_rules, cap):
    """``answer_score`` of one prompt with no cache, the op's cache, every rule's, and everything exact."""
    scores = {}
    linearize.respec(model, sparse_cache=0)
    scores["no cache"] = answer_score(model, tok, trial)
    linearize.respec(model, sparse_cache=cap)
    scores[f"op (S={cap})"] = answer_score(model, tok, trial)
    for rule in all_rules:
        scores[rule.name] = answer_score(model, tok, trial, rule)
    linearize.respec(model, sparse_cache=len(trial.ids) + 16)
    scores["everything exact"] = answer_score(model, tok, trial)
    linearize.respec(model, sparse_cache=cap)
    row = dict(length=trial.length, depth=trial.depth, trial=trial.index, tokens=len(trial.ids), scores=scores)
    print(json.dumps(row), flush=True)
    return row


def _mean(xs):
    return round(sum(xs) / len(xs), 4) if xs else None


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _kind(tok, ids, p, needle):
    """A coarse class of the token at ``p``: needle digit, the first 4 tokens, head / tail text,
    punctuation, newline or filler word."""
    if p in needle:
        return "needle digit"
    if p < 4:
        return "first 4"
    if min(needle) - 6 <= p <= max(needle) + 4:
        return "needle words"
    s = tok.convert_ids_to_tokens(ids[p])
    if "Ċ" in s:
        return "newline"
    if s.strip("Ġ") in {".", ",", "?", "!"}:
        return "punctuation"
    return "filler word"


def _summary(results):
    out = {}
    for row in results:
        if row["in_window"]:
            continue
        for name, r in row["rules"].items():
            out.setdefault(name, {}).setdefault(row["length"], []).append(r["all_digits"])
    return {name: {ln: sum(v) / len(v) for ln, v in d.items()} for name, d in out.items()}


if __name__ == "__main__":
    main()
