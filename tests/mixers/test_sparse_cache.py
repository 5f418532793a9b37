"""The LoLCATs hybrid with a sparse exact cache (LoLA): the three forms agree in float64 (values,
gradients, final states) under either priority, it reduces to the hybrid and to softmax at its
extremes, padding is invisible, it keeps the tokens the linear state recalls worst (``recall``) or
a one-off token among repeats (``novelty``), and a converted model decodes with it."""

import pytest
import torch

import linearize
from helpers import (cache_bytes_after, decode_incrementally, greedy_by_full_forwards, left_padded, plain_generate,
                     random_grads, tiny_student)
from linearize import LinearizeError, ops
from linearize.cache import LinearizeCache
from linearize.info import state_bytes
from linearize.ops.hybrid import ANCHORS

TOL = 1e-10


def _inputs(b, h, hk, t, d=4, f=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    xs = [r(b, h, t, d), r(b, hk, t, d), r(b, h, t, f).exp() * 0.3, r(b, hk, t, f).exp() * 0.3, r(b, hk, t, d)]
    gamma = torch.sigmoid(r(h))
    for x in xs + [gamma]:
        x.requires_grad_(True)
    return xs, gamma


def _close(a, b):
    assert torch.allclose(a, b, atol=TOL, rtol=0), (a - b).abs().max().item()


def _same_state(a: ops.SparseHybridState, b: ops.SparseHybridState):
    """Equal states: the window and linear state as they are, the cache as a set (slots may differ in order)."""
    for x, y in zip(a.tensors()[:6], b.tensors()[:6]):
        assert torch.equal(x, y) if x.dtype == torch.bool else torch.allclose(x, y, atol=TOL, rtol=0)
    assert torch.equal(a.count, b.count)

    def canonical(s):
        key = torch.where(s.cache_valid, s.cache_pos, torch.iinfo(torch.long).max)
        order = key.argsort(dim=-1)
        pick = lambda x: x.gather(2, order[..., None].expand_as(x)) if x.dim() == 4 else x.gather(2, order)  # noqa: E731
        return [pick(x) for x in (s.cache_keys, s.cache_features, s.cache_values, s.cache_valid, s.cache_scores,
                                  s.cache_pos)], s.cache_valid.gather(2, order)

    (xa, va), (xb, vb) = canonical(a), canonical(b)
    assert torch.equal(va, vb)
    for x, y in zip(xa, xb):
        x, y = (torch.where(va.view(*va.shape, *([1] * (x.dim() - 3))), z, torch.zeros((), dtype=z.dtype)) for z in (x, y))
        assert torch.equal(x, y) if x.dtype in (torch.bool, torch.long) else torch.allclose(x, y, atol=TOL, rtol=0)


# (batch, query heads, key heads, length, window, cache): GQA and MHA, lengths off the chunk, shorter
# than the window, a cache larger than what ever leaves it
CASES = [(2, 4, 2, 23, 3, 2), (1, 6, 3, 17, 4, 3), (2, 2, 2, 13, 4, 1), (1, 4, 1, 5, 8, 2), (1, 2, 1, 19, 1, 30)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("priority,anchor", [("recall", "joint"), ("novelty", "joint"), ("recall", "window"),
                                             ("first", "joint")])
def test_sparse_forms_agree(case, softcap, priority, anchor):
    b, h, hk, t, w, cap = case
    xs, gamma = _inputs(b, h, hk, t)
    kw = dict(window=w, cache_size=cap, scale=0.5, softcap=softcap, priority=priority, anchor=anchor)
    ref = ops.sparse_hybrid_attention_naive(*xs, gamma, **kw)
    chunked, s_chunk = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, output_final_state=True)
    rec, s_rec = ops.sparse_hybrid_attention_recurrent(*xs, gamma, **kw)
    _close(chunked, ref)
    _close(rec, ref)
    _same_state(s_chunk, s_rec)
    inputs = (*xs, gamma)
    for g_ref, g_chunk, g_rec in zip(random_grads(ref, inputs), random_grads(chunked, inputs), random_grads(rec, inputs)):
        _close(g_chunk, g_ref)
        _close(g_rec, g_ref)


def test_no_cache_is_the_hybrid():
    xs, gamma = _inputs(2, 6, 2, 21)
    kw = dict(window=4, scale=0.5)
    hybrid = ops.hybrid_attention_naive(*xs, gamma, **kw)
    _close(ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, cache_size=0)[0], hybrid)
    _close(ops.sparse_hybrid_attention_recurrent(*xs, gamma, **kw, cache_size=0)[0], hybrid)


def test_a_cache_holding_everything_is_softmax():
    """When every token that leaves the window fits the cache, nothing is linear: exact softmax."""
    xs, gamma = _inputs(2, 6, 2, 19)
    q, k, _, _, v = xs
    out, _ = ops.sparse_hybrid_attention_chunked(*xs, gamma, window=3, cache_size=16, scale=0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                            is_causal=True, scale=0.5)
    _close(out, sdpa)


@pytest.mark.parametrize("window", [3, 4])
@pytest.mark.parametrize("priority,anchor", [("recall", "joint"), ("novelty", "joint"), ("recall", "window"),
                                             ("first", "window")])
def test_padding_is_invisible_and_decoding_resumes_anywhere(window, priority, anchor):
    """Left padding (and a padded token inside) changes no real token's output in any form; each
    sequence decides exactly as it would alone (epochs count from its first real token); decoding
    on from a prefill of any length equals one pass."""
    xs, gamma = _inputs(3, 4, 2, 22, seed=2)
    mask = torch.ones(3, 22, dtype=torch.bool)
    mask[1, :5] = False
    mask[2, :10] = False
    mask[2, 14] = False
    kw = dict(window=window, cache_size=2, scale=0.5, priority=priority, anchor=anchor)
    ref = ops.sparse_hybrid_attention_naive(*xs, gamma, **kw, key_mask=mask)
    chunked, s_chunk = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, key_mask=mask, output_final_state=True)
    rec, s_rec = ops.sparse_hybrid_attention_recurrent(*xs, gamma, **kw, key_mask=mask)
    _close(chunked, ref)
    _close(rec, ref)
    _same_state(s_chunk, s_rec)
    alone = ops.sparse_hybrid_attention_chunked(*(x[1:2, :, 5:] for x in xs), gamma, **kw)[0]
    _close(ref[1:2, :, 5:], alone)
    assert not ref[1:2, :, :5].any()  # padding queries output zero
    for cut in (1, 7, 11, 16, 21):
        _, state = ops.sparse_hybrid_attention_chunked(*(x[:, :, :cut] for x in xs), gamma, **kw,
                                                       key_mask=mask[:, :cut], output_final_state=True)
        rest, _ = ops.sparse_hybrid_attention_recurrent(*(x[:, :, cut:] for x in xs), gamma, **kw,
                                                        initial_state=state, key_mask=mask[:, cut:])
        _close(rest, ref[:, :, cut:])


def test_the_token_recalled_worst_is_kept():
    """A token whose value the linear state cannot read back (a large, odd value: a pass key) stays
    in a one-token cache long after leaving the window; a typical token would not."""
    xs, gamma = _inputs(1, 2, 1, 40, d=4, f=6, seed=4)
    q, k, qf, kf, v = (x.detach() for x in xs)
    v = v * 0.1
    v[0, 0, 9] = torch.tensor([20.0, -20.0, 20.0, -20.0], dtype=torch.float64)
    kw = dict(window=4, cache_size=1, scale=0.5)
    _, state = ops.sparse_hybrid_attention_chunked(q, k, qf, kf, v, gamma.detach(), **kw, output_final_state=True)
    assert state.cache_valid.all() and state.cache_pos.flatten().tolist() == [9]
    _, state = ops.sparse_hybrid_attention_recurrent(q, k, qf, kf, v, gamma.detach(), **kw)
    assert state.cache_pos.flatten().tolist() == [9]


def test_novelty_keeps_a_one_off_token_among_repeats():
    """A pass key in repeated filler: the filler alternates two large values, the key's value is small
    and points elsewhere. The linear state reads the filler back worse than the key (when the key
    leaves the window its self-recall error is the lowest of its epoch), so the recall rule caches
    filler; the novelty rule sees that every filler value has a near-copy among the candidates and
    keeps the key, in the chunked and the recurrent form alike."""
    g = torch.Generator().manual_seed(7)
    t, w = 40, 6  # every leaver set holds each filler value at least twice, the key's set too
    q = torch.randn(1, 2, t, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, t, 4, generator=g, dtype=torch.float64)
    qf = torch.randn(1, 2, t, 6, generator=g, dtype=torch.float64).exp()
    kf = torch.randn(1, 1, t, 6, generator=g, dtype=torch.float64).exp()
    v = torch.zeros(1, 1, t, 4, dtype=torch.float64)
    v[0, 0, 0::2, 0], v[0, 0, 1::2, 0] = 10.0, -10.0  # the filler: two values, alternating
    v[0, 0, :, 1:] = 0.01 * torch.randn(t, 3, generator=g, dtype=torch.float64)  # not exact copies
    v[0, 0, 9] = torch.tensor([0.0, 1.0, 0.5, -0.5], dtype=torch.float64)  # the key
    gamma = torch.tensor([0.3, 0.6], dtype=torch.float64)
    kept = {}
    for priority in ("recall", "novelty"):
        kw = dict(window=w, cache_size=1, scale=0.5, priority=priority)
        _, state = ops.sparse_hybrid_attention_chunked(q, k, qf, kf, v, gamma, **kw, output_final_state=True)
        _, s_rec = ops.sparse_hybrid_attention_recurrent(q, k, qf, kf, v, gamma, **kw)
        _same_state(state, s_rec)
        kept[priority] = state.cache_pos.flatten().tolist()
    assert kept["novelty"] == [9]
    assert kept["recall"] != [9]


def test_first_keeps_the_sequences_first_tokens_for_good():
    """``priority="first"``: the cache holds each sequence's first S real tokens (positions from its own
    origin, left padding before it) whatever the values, in the chunked and the recurrent form, and
    decoding on never replaces them."""
    xs, gamma = _inputs(2, 4, 2, 31, seed=5)
    mask = torch.ones(2, 31, dtype=torch.bool)
    mask[1, :6] = False
    kw = dict(window=4, cache_size=3, scale=0.5, priority="first", key_mask=mask)
    _, state = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, output_final_state=True)
    _, s_rec = ops.sparse_hybrid_attention_recurrent(*xs, gamma, **kw)
    _same_state(state, s_rec)
    assert state.cache_valid.all()
    assert sorted(state.cache_pos[0, 0].tolist()) == sorted(state.cache_pos[1, 1].tolist()) == [0, 1, 2]
    more = [torch.randn(x.shape[0], x.shape[1], 9, x.shape[3], generator=torch.Generator().manual_seed(6),
                        dtype=x.dtype) for x in xs]
    more[2], more[3] = more[2].exp(), more[3].exp()  # features stay positive
    _, after = ops.sparse_hybrid_attention_recurrent(*more, gamma, **{**kw, "key_mask": None}, initial_state=state)
    assert torch.equal(after.cache_pos.sort(-1).values, state.cache_pos.sort(-1).values)
    torch.testing.assert_close(after.cache_keys.sort(-2).values, state.cache_keys.sort(-2).values, atol=0, rtol=0)


def test_window_anchor_keeps_the_trained_balance_of_window_and_linear_terms():
    """With ``anchor="window"`` a cached token weighs what it would in the window: against the plain
    hybrid (no cache), caching a token moves only that token's weight from phi_q . phi_k to
    gamma exp(s - c_w) (c_w the window's largest score), so a cache whose tokens score above the
    window leaves the window's terms and the linear terms as they were. Under "joint" those tokens
    raise c and shrink every softmax term against the linear ones: the two differ exactly there."""
    g = torch.Generator().manual_seed(3)
    t, w = 16, 4
    q = torch.randn(1, 2, t, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, t, 4, generator=g, dtype=torch.float64)
    qf = torch.randn(1, 2, t, 6, generator=g, dtype=torch.float64).exp()
    kf = torch.randn(1, 1, t, 6, generator=g, dtype=torch.float64).exp()
    v = torch.randn(1, 1, t, 4, generator=g, dtype=torch.float64)
    gamma = torch.tensor([0.4, 0.7], dtype=torch.float64)
    kw = dict(window=w, cache_size=1, scale=0.5)
    _, state = ops.sparse_hybrid_attention_chunked(q, k, qf, kf, v, gamma, **kw, output_final_state=True)
    p = state.cache_pos.flatten().tolist()[0]  # the token cached at the end (chosen from features and values)
    k[0, 0, p] = 2.0 * q[0, 0, -1]  # it scores far above the window for the last query of head 0
    _, again = ops.sparse_hybrid_attention_chunked(q, k, qf, kf, v, gamma, **kw, output_final_state=True)
    assert again.cache_pos.flatten().tolist() == [p] and p < t - w
    out = {a: ops.sparse_hybrid_attention_naive(q, k, qf, kf, v, gamma, **kw, anchor=a)[0, :, -1] for a in ANCHORS}
    # by hand, for the last query: window, token p exact, the rest linear, on the window's scale
    win, lin = list(range(t - w, t)), [s for s in range(t - w) if s != p]
    for h in range(2):
        s_all = (k[0, 0] @ q[0, h, -1]) * 0.5
        c_w = s_all[win].max()
        assert h == 1 or s_all[p] > c_w + 1  # the premise: the cached token outscores the window
        a = torch.zeros(t, dtype=torch.float64)
        a[win + [p]] = gamma[h] * torch.exp(s_all[win + [p]] - c_w)
        a[lin] = kf[0, 0, lin] @ qf[0, h, -1]
        torch.testing.assert_close(out["window"][h], a @ v[0, 0] / a.sum(), atol=1e-12, rtol=0)
    assert not torch.allclose(out["joint"][0], out["window"][0])


def test_the_anchor_matters_only_with_a_cache():
    xs, gamma = _inputs(2, 4, 2, 19)
    kw = dict(window=4, scale=0.5)
    for cap in (0,):
        a, b = (ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, cache_size=cap, anchor=x)[0] for x in ANCHORS)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    a, b = (ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, cache_size=3, anchor=x)[0] for x in ANCHORS)
    assert not torch.allclose(a, b)


def test_unknown_priority_fails():
    xs, gamma = _inputs(1, 2, 1, 9)
    for form in (ops.sparse_hybrid_attention_naive, ops.sparse_hybrid_attention_chunked):
        with pytest.raises(ValueError, match="priority must be one of"):
            form(*xs, gamma, window=2, cache_size=1, scale=0.5, priority="attention")
        with pytest.raises(ValueError, match="anchor must be one of"):
            form(*xs, gamma, window=2, cache_size=1, scale=0.5, anchor="cache")


def test_runs_under_bfloat16_autocast():
    xs, gamma = _inputs(1, 4, 2, 40)
    ref = ops.sparse_hybrid_attention_naive(*xs, gamma, window=8, cache_size=4, scale=0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = ops.sparse_hybrid_attention_chunked(*(x.detach().float() for x in xs), gamma.detach().float(),
                                                     window=8, cache_size=4, scale=0.5)
    torch.testing.assert_close(out.double(), ref.detach(), atol=0.1, rtol=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("priority", ["recall", "novelty", "first"])
def test_forms_agree_on_cuda(priority):
    """The chunked form's selection (argsorts, cumulative sums, scatters) on CUDA, in float64, against
    the decoding form, at SmolLM2's head sizes and a cache of 16 beside a window of 16."""
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float64)  # noqa: E731
    b, h, hk, t, d, f = 2, 9, 3, 300, 64, 32
    xs = [r(b, h, t, d) * 0.3, r(b, hk, t, d) * 0.3, torch.softmax(r(b, h, t, f), -1), torch.softmax(r(b, hk, t, f), -1),
          r(b, hk, t, d)]
    gamma = torch.full((h,), 0.1, device="cuda", dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.bool, device="cuda")
    mask[1, :37] = False
    kw = dict(window=16, cache_size=16, scale=d ** -0.5, key_mask=mask, priority=priority)
    chunked, s_chunk = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw, output_final_state=True)
    rec, s_rec = ops.sparse_hybrid_attention_recurrent(*xs, gamma, **kw)
    _close(chunked, rec)
    _same_state(s_chunk, s_rec)


# --- the model ---------------------------------------------------------------------------------------

SPEC = {"kind": "lolcats", "window": 4, "feature_dim": 8, "sparse_cache": 3}


@pytest.mark.parametrize("family,priority,anchor", [("llama", "recall", "joint"), ("gemma2", "recall", "joint"),
                                                    ("gpt_neox", "recall", "joint"), ("llama", "novelty", "joint"),
                                                    ("llama", "recall", "window"), ("llama", "first", "window")])
def test_decoding_through_the_cache_equals_parallel_forward(tiny_model, family, priority, anchor):
    student = tiny_student(tiny_model, family, {**SPEC, "sparse_priority": priority, "sparse_anchor": anchor})
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(decode_incrementally(student, ids, 13), student(ids, use_cache=False).logits,
                               atol=1e-10, rtol=0)
    prompt = ids[:1, :7]
    out = plain_generate(student, prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(student, prompt, 12))


def test_left_padded_batch_generates_like_single_sequences(tiny_model):
    student = tiny_student(tiny_model, "llama", SPEC, dtype=torch.float32)
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 6)]
    width = max(len(p) for p in prompts)
    ids, mask = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    batch = plain_generate(student, ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = plain_generate(student, p[None], max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(batch[i, width:], alone[0, len(p):])


def test_constant_memory_counted_by_state_bytes(tiny_model):
    student = linearize.convert(tiny_model("llama"), SPEC)

    small, large = cache_bytes_after(student, 16), cache_bytes_after(student, 96)
    assert small == large
    without = state_bytes(linearize.convert(tiny_model("llama"), {**SPEC, "sparse_cache": 0}))["fixed"]
    fixed = state_bytes(student)["fixed"]
    window_flags = 3 * 4  # the window's padding flags (bool), left out of state_bytes as for the hybrid
    assert fixed + window_flags == large and fixed > without


def test_respec_gives_a_converted_checkpoint_a_cache(tiny_model, tmp_path):
    """Training-free: a saved LoLCATs student takes a sparse cache; the record survives save/load."""
    from helpers import tiny_tokenizer

    student = linearize.convert(tiny_model("llama"), {"kind": "lolcats", "window": 4})
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    before = student(ids).logits
    linearize.respec(student, sparse_cache=4)
    after = student(ids).logits
    assert not torch.allclose(before, after)
    assert student.config.linearize["spec"]["sparse_cache"] == 4
    linearize.save(student, tiny_tokenizer(), tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu")
    torch.testing.assert_close(loaded(ids).logits, after, atol=0, rtol=0)
    linearize.respec(student, sparse_priority="recall")
    assert student.config.linearize["spec"]["sparse_priority"] == "recall"
    recall = student(ids).logits
    assert not torch.allclose(recall, after)
    linearize.save(student, tiny_tokenizer(), tmp_path / "recall")
    loaded, _ = linearize.load(tmp_path / "recall", device="cpu")
    assert linearize.spec_of(loaded).sparse_priority == "recall"
    torch.testing.assert_close(loaded(ids).logits, recall, atol=0, rtol=0)
    with pytest.raises(LinearizeError, match="respec changes only"):
        linearize.respec(student, window=8)


def test_a_cache_given_to_a_model_without_one_takes_the_default_rules(tiny_model):
    """The rules a cacheless spec records did nothing: ``respec(sparse_cache=S)`` gives the defaults
    (novelty, window, the linear terms as trained) unless the call names others; a model that has a
    cache keeps its own rules when only S changes."""
    student = linearize.convert(tiny_model("llama"), {"kind": "lolcats", "window": 4, "sparse_priority": "recall",
                                                      "sparse_anchor": "joint", "sparse_linear": 0.5})
    spec = linearize.spec_of(linearize.respec(student, sparse_cache=4))
    assert (spec.sparse_priority, spec.sparse_anchor, spec.sparse_linear) == ("novelty", "window", 1.0)
    linearize.respec(student, sparse_priority="recall", sparse_linear=0.5)
    spec = linearize.spec_of(linearize.respec(student, sparse_cache=8))
    assert (spec.sparse_cache, spec.sparse_priority, spec.sparse_linear) == (8, "recall", 0.5)
    fresh = linearize.convert(tiny_model("llama"), {"kind": "lolcats", "window": 4})
    spec = linearize.spec_of(linearize.respec(fresh, sparse_cache=4, sparse_anchor="joint"))
    assert (spec.sparse_priority, spec.sparse_anchor) == ("novelty", "joint")


def test_a_checkpoint_saved_before_sparse_priority_loads_with_recall(tiny_model, tmp_path):
    """A record whose spec has a sparse cache but no ``sparse_priority`` or ``sparse_anchor`` key (saved
    before the keys existed) loads with LoLA's rules, ``recall`` and ``joint``, as it ran then."""
    import json

    from helpers import tiny_tokenizer

    student = linearize.convert(tiny_model("llama"), {"kind": "lolcats", "window": 4, "sparse_cache": 4,
                                                      "sparse_priority": "recall", "sparse_anchor": "joint"})
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    linearize.save(student, tiny_tokenizer(), tmp_path / "old")
    config = tmp_path / "old" / "config.json"
    record = json.loads(config.read_text())
    del record["linearize"]["spec"]["sparse_priority"], record["linearize"]["spec"]["sparse_anchor"]
    config.write_text(json.dumps(record))
    loaded, _ = linearize.load(tmp_path / "old", device="cpu")
    spec = linearize.spec_of(loaded)
    assert (spec.sparse_priority, spec.sparse_anchor) == ("recall", "joint")
    torch.testing.assert_close(loaded(ids).logits, student(ids).logits, atol=0, rtol=0)


def test_the_priorities_are_the_specs():
    from linearize.ops.hybrid import PRIORITIES
    from linearize.spec import SPARSE_PRIORITIES

    assert PRIORITIES == SPARSE_PRIORITIES


def test_a_sparse_priority_flag_without_a_cache_fails_with_one_line(tmp_path, capsys):
    """``--sparse-priority`` on convert or a recipe needs ``--sparse-cache`` (or sparse_cache in the
    recipe): without a cache it would change nothing. With one, it reaches the spec."""
    from linearize.cli import _spec_from_args, build_parser, main

    for command in ("convert", "lolcats"):
        argv = [command, "--teacher", str(tmp_path / "absent"), "--out", str(tmp_path / "out"),
                "--sparse-priority", "novelty"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--sparse-priority" in err and "--sparse-cache" in err and err.count("\n") == 1, err
    args = build_parser().parse_args(["convert", "--out", str(tmp_path / "out"), "--sparse-cache", "8",
                                      "--sparse-priority", "novelty"])
    spec, _ = _spec_from_args(args)
    assert (spec["sparse_cache"], spec["sparse_priority"]) == (8, "novelty")


def test_bad_cache_specs_fail_with_one_line(tiny_model):
    for bad in [{"sparse_cache": -1}, {"sparse_cache": 2.5}, {"kind": "linear", "sparse_cache": 4},
                {"sparse_cache": 4, "sparse_priority": "attention"}]:
        with pytest.raises(LinearizeError) as err:
            linearize.convert(tiny_model("llama"), bad)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("family,priority,anchor", [("llama", "recall", "joint"), ("qwen3", "recall", "joint"),
                                                    ("llama", "novelty", "joint"), ("llama", "recall", "window"),
                                                    ("llama", "first", "window")])
def test_fast_decoder_equals_generate_with_a_cache(tiny_model, family, priority, anchor, monkeypatch):
    """The fast decoder (fixed buffers, batched, left padding) decodes a student with a sparse cache as
    generate() does: greedy tokens equal, each sequence of a left-padded batch as alone, past many
    window wrap-arounds and cache evictions."""
    from linearize.fast import fast_generate

    student = tiny_student(tiny_model, family, {"kind": "lolcats", "window": 3, "feature_dim": 8, "sparse_cache": 2,
                                                "sparse_priority": priority, "sparse_anchor": anchor})
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 97, (n,), generator=g) for n in (9, 4, 6)]
    ids, mask = left_padded(prompts)
    ring_steps = []
    real_step = ops.sparse_hybrid_attention_step_ring
    monkeypatch.setattr(ops, "sparse_hybrid_attention_step_ring",
                        lambda *a, **k: ring_steps.append(1) or real_step(*a, **k))
    batch = fast_generate(student, ids, mask, max_new_tokens=16, pad_token_id=0)
    assert len(ring_steps) == 15 * 3  # every decode step of every layer on the fixed buffers
    for i, p in enumerate(prompts):
        ref = plain_generate(student, p[None], max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert torch.equal(batch[i, ids.shape[1]:], ref[0, len(p):]), i
    assert torch.equal(fast_generate(student, prompts[0][None], max_new_tokens=20),
                       greedy_by_full_forwards(student, prompts[0][None], 20))


def test_eval_takes_a_sparse_cache_without_training(tmp_path, monkeypatch, tiny_model, capsys):
    """`linearize eval CK --sparse-cache S [--sparse-priority P]` scores the checkpoint with S exact
    tokens per layer kept by rule P (its spec in the record says so); S = 0 is the checkpoint as saved;
    a teacher is refused in one line, and so is a priority for a checkpoint without a cache."""
    import json

    from helpers import tiny_tokenizer
    from linearize.cli import main

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 77 + 20}" for i in range(400)))
    teacher = tiny_model("llama")
    linearize.save(linearize.convert(teacher, {"kind": "lolcats", "window": 4}), tiny_tokenizer(), tmp_path / "ck")
    linearize.save(teacher, tiny_tokenizer(), tmp_path / "teacher")
    ppl = {}
    for s in (0, 8):
        out = tmp_path / f"s{s}.json"
        assert main(["eval", str(tmp_path / "ck"), "--source", str(text), "--block-len", "64", "--device", "cpu",
                     "--quiet", "--sparse-cache", str(s), "--out", str(out)]) == 0
        record = json.loads(out.read_text())
        assert record["model"]["spec"]["sparse_cache"] == s
        ppl[s] = record["perplexity"]["value"]
    assert ppl[0] != ppl[8]
    spec = json.loads((tmp_path / "s8.json").read_text())["model"]["spec"]  # the defaults: novelty, window
    assert (spec["sparse_priority"], spec["sparse_anchor"]) == ("novelty", "window")
    out = tmp_path / "recall.json"
    assert main(["eval", str(tmp_path / "ck"), "--source", str(text), "--block-len", "64", "--device", "cpu",
                 "--quiet", "--sparse-cache", "8", "--sparse-priority", "recall", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert (record["model"]["spec"]["sparse_cache"], record["model"]["spec"]["sparse_priority"]) == (8, "recall")
    assert record["perplexity"]["value"] != ppl[8]
    out = tmp_path / "anchor.json"
    assert main(["eval", str(tmp_path / "ck"), "--source", str(text), "--block-len", "64", "--device", "cpu",
                 "--quiet", "--sparse-cache", "8", "--sparse-anchor", "joint", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert (record["model"]["spec"]["sparse_cache"], record["model"]["spec"]["sparse_anchor"]) == (8, "joint")
    assert record["perplexity"]["value"] != ppl[8]
    assert main(["eval", str(tmp_path / "teacher"), "--source", str(text), "--device", "cpu", "--quiet",
                 "--sparse-cache", "8"]) == 2
    capsys.readouterr()
    # a priority for a checkpoint without a cache (and no --sparse-cache) would change nothing: refused
    assert main(["eval", str(tmp_path / "ck"), "--source", str(text), "--device", "cpu", "--quiet",
                 "--sparse-priority", "novelty"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # after the load's progress
    assert len(errors) == 1 and errors[0].startswith("linearize: error: --sparse-priority"), errors
    assert "sparse_cache 0" in errors[0] and "--sparse-cache S" in errors[0]
    assert main(["eval", str(tmp_path / "ck"), "--source", str(text), "--device", "cpu", "--quiet",
                 "--sparse-anchor", "window"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("linearize: error: --sparse-anchor"), errors


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prefill", [1, 2, 9])
@pytest.mark.parametrize("priority,anchor", [("recall", "joint"), ("novelty", "joint"), ("recall", "window"),
                                             ("first", "joint")])
def test_ring_step_is_the_step_in_place(case, prefill, priority, anchor):
    """The fast decoder's form (a fixed ring of w slots, updated in place, no host synchronisation)
    gives the step's outputs and decisions token by token, from prefixes shorter and longer than the
    window and with a left-padded row, across epoch boundaries and ring wrap-arounds."""
    b, h, hk, t, w, cap = case
    xs, _ = _inputs(b, h, hk, t + prefill)
    q, k, qf, kf, v = (x.detach() for x in xs)
    gamma = torch.sigmoid(torch.randn(h, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    mask = torch.ones(b, t + prefill, dtype=torch.bool)
    if b > 1:
        mask[1, : min(prefill, 2)] = False  # the second row starts with padding
    state = ops.empty_sparse_hybrid_state(b, hk, q.shape[-1], qf.shape[-1], cap, dtype=torch.float64)
    at = lambda x, i: x[:, :, i : i + 1]  # noqa: E731
    kw = dict(scale=0.5, softcap=None, priority=priority, anchor=anchor)
    for i in range(prefill):  # the prefix, as a prefill leaves it
        _, state = ops.sparse_hybrid_attention_step(*(at(x, i) for x in (q, k, qf, kf, v)), gamma, state, window=w,
                                                    key_mask=mask[:, i : i + 1], **kw)
    ring = ops.RingSparseState.from_state(state.map(torch.clone), w)
    for i in range(prefill, prefill + t):
        args = [at(x, i) for x in (q, k, qf, kf, v)]
        y, state = ops.sparse_hybrid_attention_step(*args, gamma, state, window=w, key_mask=mask[:, i : i + 1], **kw)
        y_ring, ring = ops.sparse_hybrid_attention_step_ring(*args, gamma, ring, key_mask=mask[:, i : i + 1], **kw)
        _close(y_ring, y)
    assert torch.equal(ring.count, state.count)
    _close(ring.linear, state.linear)
    # the cache holds the same tokens (slots may differ in order)
    assert torch.equal(ring.cache_valid.sum(-1), state.cache_valid.sum(-1))
    key = lambda s: torch.where(s.cache_valid, s.cache_pos, -1).sort(-1).values  # noqa: E731
    assert torch.equal(key(ring), key(state))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("anchor", ANCHORS)
@pytest.mark.parametrize("padded", [False, True])
def test_first_without_a_state_decides_in_closed_form(case, anchor, padded):
    """``priority="first"`` without a final state (training, scoring) takes its decisions in closed form:
    the same folds and cache per chunk as the general selection loop, and the same outputs and gradients
    as the naive form, with left padding and a padded token inside."""
    from linearize.ops.hybrid.sparse_select import _select, _select_first

    b, h, hk, t, w, cap = case
    xs, gamma = _inputs(b, h, hk, t, seed=3)
    mask = None
    if padded:
        mask = torch.ones(b, t, dtype=torch.bool)
        mask[0, : min(2, t - 1)] = False  # left padding
        if t > 6:
            mask[-1, 5] = False  # a hole
    kw = dict(window=w, cache_size=cap, scale=0.5, priority="first", anchor=anchor, key_mask=mask)
    ref = ops.sparse_hybrid_attention_naive(*xs, gamma, **kw)
    fast, state = ops.sparse_hybrid_attention_chunked(*xs, gamma, **kw)
    assert state is None
    _close(fast, ref)
    inputs = (*xs, gamma)
    for g_fast, g_ref in zip(random_grads(fast, inputs), random_grads(ref, inputs)):
        _close(g_fast, g_ref)
    # the decisions themselves, against the loop (origins on chunk boundaries, as the chunked form rolls them)
    n = -(-t // w)
    real = torch.ones(b, n * w, dtype=torch.bool)
    real[:, t:] = False
    if padded:
        real[0, : w * (1 if n > 2 else 0)] = False  # an origin one chunk in
        if n * w > 6:
            real[-1, 5] = False
    kf = torch.rand(b, hk, n * w, 3, dtype=torch.float64)
    v = torch.randn(b, hk, n * w, 2, dtype=torch.float64)
    fold, slot_pos, slot_valid, _ = _select(kf, v, real, w, cap, "first")
    fold_c, pos_c, valid_c = _select_first(real, hk, w, cap)
    assert torch.equal(fold_c, fold)
    assert torch.equal(valid_c, slot_valid)
    assert torch.equal(torch.where(valid_c, pos_c, -1), torch.where(slot_valid, slot_pos, -1))


def test_first_tokens_take_the_fused_decode_state_once_cached(tiny_model, monkeypatch):
    """Attention sinks (``sparse_priority: first``) where the fused decode step runs: the prefill's state
    becomes a ``FusedSinkState`` holding the cached first tokens once every sequence's have left the
    window, the sparse cache's own ring before; ``fast_state_bytes`` counts the fused state."""
    from linearize.convert import mixers
    from linearize.mixers.lolcats import LolcatsAttention

    monkeypatch.setattr(LolcatsAttention, "fused_decoding", lambda self: True)  # as on CUDA
    student = linearize.convert(tiny_model("llama"), {"kind": "lolcats", "window": 4, "feature_dim": 8,
                                                      "sparse_cache": 2, "sparse_priority": "first"})
    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    for padding, fused in ((2, True), (5, False)):  # 7 real tokens: 3 have left a window of 4; 4: none
        mask = torch.ones_like(ids)
        mask[1, :padding] = 0
        cache = LinearizeCache(student)
        with torch.no_grad():
            student(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for i, m in mixers(student).items():
            sparse = cache.layers[i].state
            sinks = sparse.cache_keys.clone()
            state = m.ring_state(sparse)
            assert isinstance(state, ops.FusedSinkState if fused else ops.RingSparseState)
            if fused:
                assert torch.equal(state.sink_keys, sinks) and bool(state.sink_valid.all())
                held = sum(x.numel() * x.element_size() for x in (state.keys, state.values, state.linear,
                                                                   state.sink_keys, state.sink_values, state.sink_valid))
                assert m.fast_state_bytes(torch.float32) == held // 2  # batch of 2


@pytest.mark.parametrize("decay", [None, "learned"])
def test_novelty_ties_between_copies_are_decided_alike_in_every_form(tiny_model, decay):
    """Repeated tokens give the first layer copies of one value (cosine 1 up to each form's rounding):
    the cosines are rounded to a grid, so the prefill's chunked form and the decoding steps keep the
    same tokens and decoding equals the forward (before the grid: 6e-3 apart on these ids)."""
    from helpers import gated_student

    student = gated_student(tiny_model, {"kind": "lolcats", "window": 3, "feature_dim": 8, "sparse_cache": 4,
                                         "sparse_priority": "novelty", "decay": decay})
    ids = torch.randint(2, 97, (2, 29), generator=torch.Generator().manual_seed(0))
    assert len(set(ids[0].tolist())) < 29  # tokens repeat
    full = student(ids, use_cache=False).logits
    torch.testing.assert_close(decode_incrementally(student, ids, 13), full, atol=1e-10, rtol=0)
