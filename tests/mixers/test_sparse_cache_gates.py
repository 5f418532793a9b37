"""The sparse exact cache with the LoLCATs length options (issue #46): a fading linear state
(``log_gate``: ``decay: gated``, and ``span`` / ``learned`` as per-head constants) and features of the
q/k before RoPE (``feature_rope: false``). The three forms agree in float64 (values, gradients, the
gates' included, final states) with GQA, left padding and lengths off the chunk; no cache is the
gated hybrid; open gates are the ungated forms; closed gates leave the window, the cache and the
token folded at that very step; a tiny ``lolcats_long``-like student decodes through the cache as its
full forward computes."""

import pytest
import torch

import linearize
from helpers import (cache_bytes_after, decode_incrementally, gated_student, greedy_by_full_forwards, left_padded,
                     plain_generate, random_grads)
from linearize import LinearizeError, ops
from linearize.convert import mixers
from linearize.fast import fast_generate
from linearize.ops.hybrid.recurrent import _read_one

TOL = 1e-10


def _inputs(b, h, hk, t, d=4, f=6, seed=0, gate_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    xs = [r(b, h, t, d), r(b, hk, t, d), r(b, h, t, f).exp() * 0.3, r(b, hk, t, f).exp() * 0.3, r(b, hk, t, d)]
    gamma = torch.sigmoid(r(h))
    log_gate = -torch.nn.functional.softplus(r(b, hk, t) * gate_scale)  # data-dependent, per token and key head
    for x in xs + [gamma, log_gate]:
        x.requires_grad_(True)
    return xs, gamma, log_gate


def _close(a, b):
    assert torch.allclose(a, b, atol=TOL, rtol=0), (a - b).abs().max().item()


def _cache(s: ops.SparseHybridState):
    """The cache as a set (slots may differ in order): positions, then features and fades in that order."""
    key = torch.where(s.cache_valid, s.cache_pos, torch.iinfo(torch.long).max)
    order = key.argsort(dim=-1)
    valid = s.cache_valid.gather(2, order)
    fade = torch.where(valid, s.cache_fade.gather(2, order), 0.0)
    feats = s.cache_features.gather(2, order[..., None].expand_as(s.cache_features)) * valid[..., None]
    return key.gather(2, order), valid, fade, feats


def _same_state(a: ops.SparseHybridState, b: ops.SparseHybridState):
    for x, y in zip(a.tensors()[:6], b.tensors()[:6]):
        assert torch.equal(x, y) if x.dtype == torch.bool else torch.allclose(x, y, atol=TOL, rtol=0)
    assert torch.equal(a.count, b.count)
    (pa, va, fa, ka), (pb, vb, fb, kb) = _cache(a), _cache(b)
    assert torch.equal(va, vb) and torch.equal(torch.where(va, pa, 0), torch.where(vb, pb, 0))
    _close(fa, fb)
    _close(ka, kb)


# (batch, query heads, key heads, length, window, cache): GQA and MHA, lengths off the chunk, shorter
# than the window, a cache larger than what ever leaves it
CASES = [(2, 4, 2, 23, 3, 2), (1, 6, 3, 17, 4, 3), (2, 2, 2, 13, 4, 1), (1, 4, 1, 5, 8, 2), (1, 2, 1, 19, 1, 30)]
RULES = [("recall", "joint"), ("novelty", "joint"), ("recall", "window"), ("first", "joint")]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("priority,anchor", RULES)
def test_gated_forms_agree(case, softcap, priority, anchor):
    b, h, hk, t, w, cap = case
    xs, gamma, lg = _inputs(b, h, hk, t)
    kw = dict(window=w, cache_size=cap, scale=0.5, softcap=softcap, priority=priority, anchor=anchor, log_gate=lg)
    ref = ops.sparse_hybrid_attention_naive(*xs, gamma, **kw)
    chunked, s_chunk = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, output_final_state=True)
    plain, _ = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw)  # ("first": no closed form under gates)
    rec, s_rec = ops.sparse_hybrid_attention_recurrent(*xs, gamma, **kw)
    _close(chunked, ref)
    _close(plain, ref)
    _close(rec, ref)
    _same_state(s_chunk, s_rec)
    inputs = (*xs, gamma, lg)
    grads = random_grads(ref, inputs)
    for g_ref, g_chunk, g_rec in zip(grads, random_grads(chunked, inputs), random_grads(rec, inputs)):
        _close(g_chunk, g_ref)
        _close(g_rec, g_ref)
    assert grads[-1].abs().max() > 0 or t - w <= cap  # the gates get a gradient (where anything is folded)


@pytest.mark.parametrize("window", [3, 4])
@pytest.mark.parametrize("priority,anchor", RULES)
def test_gated_padding_is_invisible_and_decoding_resumes_anywhere(window, priority, anchor):
    """Left padding (and a padded token inside) changes no real token's output; each sequence decides as
    alone; decoding on from a prefill's state (its cached tokens' fades included) equals one pass."""
    xs, gamma, lg = _inputs(3, 4, 2, 22, seed=2)
    mask = torch.ones(3, 22, dtype=torch.bool)
    mask[1, :5] = False
    mask[2, :10] = False
    mask[2, 14] = False
    kw = dict(window=window, cache_size=2, scale=0.5, priority=priority, anchor=anchor)
    ref = ops.sparse_hybrid_attention_naive(*xs, gamma, **kw, key_mask=mask, log_gate=lg)
    chunked, s_chunk = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, key_mask=mask, output_final_state=True,
                                                           log_gate=lg)
    rec, s_rec = ops.sparse_hybrid_attention_recurrent(*xs, gamma, **kw, key_mask=mask, log_gate=lg)
    _close(chunked, ref)
    _close(rec, ref)
    _same_state(s_chunk, s_rec)
    alone = ops.sparse_hybrid_attention_chunked(*(x[1:2, :, 5:] for x in xs), gamma, **kw, log_gate=lg[1:2, :, 5:])[0]
    _close(ref[1:2, :, 5:], alone)
    assert not ref[1:2, :, :5].any()
    for cut in (1, 7, 11, 16, 21):
        _, state = ops.sparse_hybrid_attention_chunked(*(x[:, :, :cut] for x in xs), gamma, **kw,
                                                       key_mask=mask[:, :cut], output_final_state=True,
                                                       log_gate=lg[..., :cut])
        rest, _ = ops.sparse_hybrid_attention_recurrent(*(x[:, :, cut:] for x in xs), gamma, **kw,
                                                        initial_state=state, key_mask=mask[:, cut:],
                                                        log_gate=lg[..., cut:])
        _close(rest, ref[:, :, cut:])


@pytest.mark.parametrize("padded", [False, True])
def test_no_cache_is_the_gated_hybrid(padded):
    xs, gamma, lg = _inputs(2, 6, 2, 21)
    mask = torch.ones(2, 21, dtype=torch.bool)
    if padded:
        mask[1, :6] = False
    kw = dict(window=4, scale=0.5, key_mask=mask, log_gate=lg)
    hybrid = ops.hybrid_attention_naive(*xs, gamma, **kw)
    _close(ops.hybrid_attention_chunked(*xs, gamma, **kw)[0], hybrid)
    sparse, state = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, cache_size=0, output_final_state=True)
    _close(sparse, hybrid)
    _close(ops.sparse_hybrid_attention_naive(*xs, gamma, **kw, cache_size=0), hybrid)
    rec, s_rec = ops.sparse_hybrid_attention_recurrent(*xs, gamma, **kw, cache_size=0)
    _close(rec, hybrid)
    _, plain = ops.hybrid_attention_recurrent(*xs, gamma, **kw)
    _close(s_rec.linear, plain.linear)
    _close(state.linear, plain.linear)
    inputs = (*xs, gamma, lg)
    for g_ref, g_sparse in zip(random_grads(hybrid, inputs), random_grads(sparse, inputs)):
        _close(g_sparse, g_ref)


@pytest.mark.parametrize("priority,anchor", RULES)
def test_open_gates_are_the_ungated_forms(priority, anchor):
    xs, gamma, lg = _inputs(2, 4, 2, 23)
    kw = dict(window=3, cache_size=2, scale=0.5, priority=priority, anchor=anchor)
    open_ = torch.zeros_like(lg)
    ungated = ops.sparse_hybrid_attention_naive(*xs, gamma, **kw)
    for form in (ops.sparse_hybrid_attention_naive, ops.sparse_hybrid_attention_chunked,
                 ops.sparse_hybrid_attention_recurrent):
        out = form(*xs, gamma, **kw, log_gate=open_)
        _close(out if torch.is_tensor(out) else out[0], ungated)
    _, s_open = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, log_gate=open_, output_final_state=True)
    _, s_plain = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, output_final_state=True)
    assert s_plain.cache_fade is None and len(s_plain.tensors()) == 13  # no gates: the state as before
    _close(s_open.linear, s_plain.linear)
    assert not torch.where(s_open.cache_valid, s_open.cache_fade, 0.0).any()
    # gates that fade do change the output (a cache larger than the window's leavers aside)
    assert (ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, log_gate=lg)[0] - ungated).abs().max() > 1e-3


def test_closed_gates_leave_the_window_the_cache_and_the_token_folded_now():
    """With gates closed (a log gate of -1e4: every fold fades to 0 in one step) query t reads the
    window, the cache and only the token leaving the window at t where it goes straight on into the
    linear state (weight 1, as the gated hybrid reads the key leaving its window at t); a cached token
    pushed out at t has faded since it left the window and adds nothing. Decisions by value novelty do
    not read the linear state, so the ungated step's choices are the reference's."""
    b, h, hk, t, w, cap = 2, 4, 2, 26, 3, 2
    xs, gamma, _ = _inputs(b, h, hk, t, seed=6)
    q, k, qf, kf, v = (x.detach() for x in xs)
    gamma = gamma.detach()
    closed = torch.full((b, hk, t), -1e4, dtype=torch.float64)
    kw = dict(window=w, scale=0.5, priority="novelty")
    s_closed = ops.empty_sparse_hybrid_state(b, hk, 4, 6, cap, dtype=torch.float64, gated=True)
    s_open = ops.empty_sparse_hybrid_state(b, hk, 4, 6, cap, dtype=torch.float64)
    ys, straights = [], []
    at = lambda x, i: x[:, :, i : i + 1]  # noqa: E731
    real = torch.ones(b, dtype=torch.bool)
    for i in range(t):
        args = [at(x, i) for x in (q, k, qf, kf, v)]
        y, s_closed = ops.sparse_hybrid_attention_step(*args, gamma, s_closed, **kw, log_gate=closed[..., i : i + 1])
        _, s_open = ops.sparse_hybrid_attention_step(*args, gamma, s_open, **kw)
        # the token leaving the window now, where it went straight on into the linear state (a cached
        # token pushed out now has faded since it left the window: it arrives at 0)
        s = i - w
        folded_now = torch.zeros_like(s_open.linear)
        if s >= 0:
            straight = ~((s_open.cache_pos == s) & s_open.cache_valid).any(-1)  # [B, Hk]
            outer = kf[:, :, s, :, None] * torch.cat([v[:, :, s], torch.ones(b, hk, 1, dtype=v.dtype)], -1)[:, :, None]
            folded_now = (outer * straight[..., None, None])[:, :, None]
            straights.append(straight)
        _close(s_closed.linear, folded_now)
        assert torch.equal(s_closed.cache_pos * s_closed.cache_valid, s_open.cache_pos * s_open.cache_valid)
        ref = _read_one(args[0], args[2], gamma, s_open.keys, s_open.values, s_open.valid, s_open.cache_keys,
                        s_open.cache_values, s_open.cache_valid, folded_now, real, 0.5, None)
        _close(y, ref)
        ys.append(y)
    _close(ops.sparse_hybrid_attention_chunked(q, k, qf, kf, v, gamma, **kw, cache_size=cap, log_gate=closed)[0],
           torch.cat(ys, dim=2))
    straights = torch.stack(straights)
    assert straights.any() and (~straights[cap:]).any()  # both: straight on, and cached (pushing one out)


@pytest.mark.parametrize("priority", ["recall", "novelty", "first"])
def test_gated_ring_step_is_the_step_in_place(priority):
    """The fast decoder's ring step fades the state and the cached tokens as the step does."""
    b, h, hk, t, w, cap = 2, 4, 2, 17, 3, 2
    prefill = 5
    xs, _, lg = _inputs(b, h, hk, t + prefill)
    q, k, qf, kf, v = (x.detach() for x in xs)
    lg = lg.detach()
    gamma = torch.sigmoid(torch.randn(h, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    mask = torch.ones(b, t + prefill, dtype=torch.bool)
    mask[1, :2] = False
    at = lambda x, i: x[:, :, i : i + 1]  # noqa: E731
    kw = dict(scale=0.5, softcap=None, priority=priority)
    _, state = ops.sparse_hybrid_attention_chunked(q[:, :, :prefill], k[:, :, :prefill], qf[:, :, :prefill],
                                                   kf[:, :, :prefill], v[:, :, :prefill], gamma, window=w,
                                                   cache_size=cap, key_mask=mask[:, :prefill],
                                                   log_gate=lg[..., :prefill], output_final_state=True, **kw)
    ring = ops.RingSparseState.from_state(state.map(torch.clone), w)
    for i in range(prefill, prefill + t):
        args = [at(x, i) for x in (q, k, qf, kf, v)]
        m, g = mask[:, i : i + 1], lg[..., i : i + 1]
        y, state = ops.sparse_hybrid_attention_step(*args, gamma, state, window=w, key_mask=m, log_gate=g, **kw)
        y_ring, ring = ops.sparse_hybrid_attention_step_ring(*args, gamma, ring, key_mask=m, log_gate=g, **kw)
        _close(y_ring, y)
    _close(ring.linear, state.linear)
    (pa, va, fa, _), (pb, vb, fb, _) = _cache(ring), _cache(state)
    assert torch.equal(va, vb) and torch.equal(torch.where(va, pa, 0), torch.where(vb, pb, 0))
    _close(fa, fb)


# --- the model ---------------------------------------------------------------------------------------

LONG = {"kind": "lolcats", "window": 4, "feature_dim": 8, "feature_rope": False, "decay": "gated", "decay_horizon": 8}


def _student(tiny_model, spec, family="llama", dtype=torch.float64):
    return gated_student(tiny_model, spec, family, dtype)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("cache,priority", [(4, "recall"), (8, "recall"), (4, "novelty"), (4, "first")])
def test_long_student_decodes_through_the_cache_as_its_forward(tiny_model, family, cache, priority):
    student = _student(tiny_model, {**LONG, "sparse_cache": cache, "sparse_priority": priority}, family)
    ids = torch.randint(2, 97, (2, 29), generator=torch.Generator().manual_seed(0))
    full = student(ids, use_cache=False).logits
    torch.testing.assert_close(decode_incrementally(student, ids, 13), full, atol=1e-10, rtol=0)
    # the cache and the gates both matter
    plain = _student(tiny_model, LONG, family)
    assert (plain(ids, use_cache=False).logits - full).abs().max() > 1e-4
    prompt = ids[:1, :7]
    out = plain_generate(student, prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(student, prompt, 12))


@pytest.mark.parametrize("decay", ["span", "learned", "gated"])
def test_fast_decoder_with_a_fading_cache_equals_generate(tiny_model, decay, monkeypatch):
    """Every decay and features before RoPE through the fast decoder's ring (left-padded batch). In
    float64: in float32 a tiny random student's greedy tokens and cache choices sit near ties, and the
    batched prefill's rounding flips some (ungated caches too, e.g. seed 7 under ``novelty``)."""
    student = _student(tiny_model, {**LONG, "decay": decay, "window": 3, "sparse_cache": 2})
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 97, (n,), generator=g) for n in (9, 4)]
    ids, mask = left_padded(prompts)
    gated_steps = []
    real_step = ops.sparse_hybrid_attention_step_ring
    monkeypatch.setattr(ops, "sparse_hybrid_attention_step_ring",
                        lambda *a, **k: gated_steps.append(k["log_gate"] is not None) or real_step(*a, **k))
    batch = fast_generate(student, ids, mask, max_new_tokens=16, pad_token_id=0)
    assert len(gated_steps) == 15 * len(mixers(student)) and all(gated_steps)  # every decode step, every layer, faded
    for i, p in enumerate(prompts):
        ref = plain_generate(student, p[None], max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert torch.equal(batch[i, ids.shape[1]:], ref[0, len(p):]), i


def test_constant_memory_counted_by_state_bytes(tiny_model):
    """The cached tokens' fades are counted; the memory held does not grow with the length."""
    from linearize.info import state_bytes

    student = linearize.convert(tiny_model("llama"), {**LONG, "sparse_cache": 3})

    small, large = cache_bytes_after(student, 16), cache_bytes_after(student, 96)
    assert small == large
    window_flags = 3 * 4  # the window's padding flags (bool), left out of state_bytes as for the hybrid
    assert state_bytes(student)["fixed"] + window_flags == large


def test_spec_takes_a_cache_with_the_length_options_but_not_norm_separate(tiny_model):
    no_decay = {x: y for x, y in LONG.items() if x != "decay"}  # features before RoPE alone
    for spec in ({**LONG, "decay": "span"}, {**LONG, "decay": "learned"}, LONG, no_decay,
                 {**LONG, "feature_rope": True}):
        assert linearize.spec_of(linearize.convert(tiny_model("llama"), {**spec, "sparse_cache": 4})).sparse_cache == 4
    with pytest.raises(LinearizeError, match="norm separate") as err:
        linearize.convert(tiny_model("llama"), {**LONG, "norm": "separate", "sparse_cache": 4})
    assert "\n" not in str(err.value)



@pytest.mark.parametrize("priority", ["recall", "novelty"])
def test_copies_tie_in_every_form(priority):
    """Repeated tokens (the same key, features and value, as in a first layer) have one priority in every
    form, the reference's too, so the tie rule picks which copy leaves, not the last bit of each form's
    sums: naive = chunked = recurrent, and decoding on from any prefill equals one pass."""
    xs, gamma, lg = _inputs(2, 6, 2, 29, d=8, f=8, seed=1)
    ids = torch.randint(0, 7, (2, 29), generator=torch.Generator().manual_seed(0))  # 7 tokens: many copies
    with torch.no_grad():
        for i in (1, 3, 4):  # k, kf and v by token
            xs[i] = torch.stack([xs[i][b][:, ids[b]] for b in range(2)])
        kw = dict(window=4, cache_size=8, scale=12 ** -0.5, softcap=20.0, priority=priority, anchor="window")
        ref = ops.sparse_hybrid_attention_naive(*xs, gamma, **kw, log_gate=lg)
        _close(ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, log_gate=lg)[0], ref)
        _close(ops.sparse_hybrid_attention_recurrent(*xs, gamma, **kw, log_gate=lg)[0], ref)
        for cut in (5, 9, 13, 20):
            _, state = ops.sparse_hybrid_attention_chunked(*(x[:, :, :cut] for x in xs), gamma, **kw,
                                                           output_final_state=True, log_gate=lg[..., :cut])
            rest, _ = ops.sparse_hybrid_attention_recurrent(*(x[:, :, cut:] for x in xs), gamma, **kw,
                                                            initial_state=state, log_gate=lg[..., cut:])
            _close(rest, ref[:, :, cut:])
