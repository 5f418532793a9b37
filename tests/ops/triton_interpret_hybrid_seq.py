"""Run by test_hybrid_chunk_triton.py in a subprocess, on the CPU through Triton's interpreter: the hybrid's
whole-sequence kernels (``ops/hybrid/chunk_triton.py``) against the float64 references, values, gradients
and the prefill's final state.

``features``: features given to the kernels, against ``hybrid_attention_naive`` (output, every
gradient) and ``hybrid_attention_chunked`` (final state).
``hedgehog``: RoPE and Hedgehog maps inside the forward kernels, against the reference after the
rotation and the maps in float64 (gradients of the raw q, k, v, the maps' weights and gamma).
``ARGS`` picks the cases (all by default)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from linearize import ops  # noqa: E402
from linearize.ops.hybrid.chunk_triton import hedgehog_features, hybrid_triton, rope_half  # noqa: E402

from interpret_checks import TOL, _close, _masks  # noqa: E402,F401  (TOL: the cases' bound)


def _weights(y, key_mask, g):
    """A random projection of the output; zero at padding queries (their output is the constant 0)."""
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    if key_mask is not None:
        w = w * key_mask[:, None, :, None]
    return w


def _compare_state(got, want):
    for name in ("keys", "key_features", "values", "linear"):
        a, e = getattr(got, name), getattr(want, name)
        assert a.shape == e.shape, (name, a.shape, e.shape)
        _close(a, e, name)
    assert got.linear.dtype == torch.float32
    assert torch.equal(got.valid, want.valid)


def check_features(b, h, hk, t, d, f, window, softcap, pad, seed, dtype=torch.float32, grads=True):
    """``grads``: also every gradient (else the training pass's output and state, and the output without
    gradients, alone)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(b, h, t, d), r(b, hk, t, d), r(b, hk, t, d)
    qf, kf = r(b, h, t, f).exp() * 0.3, r(b, hk, t, f).exp() * 0.3
    gamma = torch.sigmoid(r(h))
    key_mask = _masks(b, t, pad)
    kw = dict(window=window, scale=d ** -0.5, softcap=softcap, key_mask=key_mask)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v, qf, kf, gamma)]
    rq, rk, rv, rqf, rkf, rg = ref_in
    want = ops.hybrid_attention_naive(rq, rk, rqf, rkf, rv, rg, **kw)
    _, want_state = ops.hybrid_attention_chunked(q, k, qf, kf, v, gamma, **kw, output_final_state=True)
    if dtype != torch.float32:  # the reference from the inputs as rounded
        rounded = [x.to(dtype).double() for x in (q, k, v, qf, kf)]
        ref_in = [x.requires_grad_() for x in rounded] + [ref_in[5]]
        rq, rk, rv, rqf, rkf, rg = ref_in
        want = ops.hybrid_attention_naive(rq, rk, rqf, rkf, rv, rg, **kw)
    tol = {torch.float32: TOL, torch.float16: 2e-3}[dtype]
    mine = [x.to(dtype).requires_grad_() for x in (q, k, v, qf, kf)] + [gamma.float().requires_grad_()]
    mq, mk, mv, mqf, mkf, mg = mine
    got, state = hybrid_triton(mq, mk, mv, mg, qf=mqf, kf=mkf, **kw, output_final_state=True)
    assert got.shape == want.shape and got.dtype == dtype
    _close(got, want, "y", tol=tol)
    if dtype == torch.float32:
        _compare_state(state, want_state)
    w = _weights(want, key_mask, g)
    grads_want = torch.autograd.grad((want * w).sum(), ref_in) if grads else ()
    grads_got = torch.autograd.grad((got.double() * w).sum(), mine) if grads else ()
    for name, a, e in zip(("q", "k", "v", "qf", "kf", "gamma"), grads_got, grads_want):
        assert a.dtype == (torch.float32 if name == "gamma" else dtype), name
        # gamma's gradient is 0 where every key is in the window (softmax alone): an absolute floor;
        # in half precision it sums terms of both signs over every query (a looser bound)
        _close(a, e, "d" + name, floor=1.0 if name == "gamma" else 1e-6, tol=tol * (5 if name == "gamma" else 1))
    # without gradients: the same output
    with torch.no_grad():
        again, _ = hybrid_triton(*(x.detach() for x in (mq, mk, mv, mg)), qf=mqf.detach(), kf=mkf.detach(), **kw)
    _close(again, want, "y (no grad)", tol=tol)


def check_hedgehog(b, h, hk, t, d, fh, rot, window, softcap, pad, seed, shared=False, alone=True):
    """``alone``: also the maps' weights' gradients alone (the rest frozen, LoLCATs stage 1)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    # q/k/v as strided views of one projection's [B, T, heads, D] output, as the adapters give them
    qkv = r(b, t, h + 2 * hk, d)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([h, hk, hk], dim=2))
    wq, wk = r(1 if shared else h, d, fh) * 0.5, r(1 if shared else hk, d, fh) * 0.5
    angles = r(1, t, rot // 2) * 3 if rot else None
    rope = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()) if rot else None
    gamma = r(h)  # the window weights' logits (the kernels take the sigmoid, as the mixer calls them)
    key_mask = _masks(b, t, pad)
    kw = dict(window=window, scale=d ** -0.5, softcap=softcap, key_mask=key_mask)

    def reference(q, k, v, wq, wk, logit):
        if rope is not None:
            q, k = rope_half(q, *rope), rope_half(k, *rope)
        qf, kf = hedgehog_features(q, wq), hedgehog_features(k, wk)
        gamma = torch.sigmoid(logit)
        y = ops.hybrid_attention_naive(q, k, qf, kf, v, gamma, **kw)
        _, state = ops.hybrid_attention_chunked(q, k, qf, kf, v, gamma, **kw, output_final_state=True)
        return y, state

    ref_in = [x.clone().requires_grad_() for x in (q, k, v, wq, wk, gamma)]
    want, want_state = reference(*ref_in)
    mine = [x.float().requires_grad_() for x in (q, k, v, wq, wk, gamma)]
    mq, mk, mv, mwq, mwk, mg = mine
    got, state = hybrid_triton(mq, mk, mv, mg, hedgehog=(mwq, mwk), rope=None if rope is None else
                               tuple(x.float() for x in rope), **kw, output_final_state=True, logit=True)
    _close(got, want, "y")
    _compare_state(state, want_state)
    w = _weights(want, key_mask, g)
    grads_want = torch.autograd.grad((want * w).sum(), ref_in)
    grads_got = torch.autograd.grad((got.double() * w).sum(), mine)
    for name, a, e in zip(("q", "k", "v", "wq", "wk", "gamma"), grads_got, grads_want):
        _close(a, e, "d" + name, floor=1.0 if name == "gamma" else 1e-6)
    if not alone:
        return
    # only the feature maps' weights train (LoLCATs stage 1): their gradients alone
    mwq2, mwk2 = (x.detach().requires_grad_() for x in (mwq, mwk))
    got2, _ = hybrid_triton(mq.detach(), mk.detach(), mv.detach(), mg.detach(), hedgehog=(mwq2, mwk2),
                            rope=None if rope is None else tuple(x.float() for x in rope), **kw, logit=True)
    for name, a, e in zip(("wq", "wk"), torch.autograd.grad((got2.double() * w).sum(), [mwq2, mwk2]),
                          grads_want[3:5]):
        _close(a, e, "d" + name + " alone")


def check_sinks(b, h, hk, t, d, fh, rot, window, cap, softcap, pad, seed, anchor="joint", state=True):
    """``hybrid_triton_sinks`` (the first ``cap`` real tokens cached, forward kernels, no gradient) against
    ``sparse_hybrid_attention_naive`` under ``priority="first"`` after the rotation and the maps in float64,
    and (``state``: the cache settled) its ``SparseHybridState`` against the chunked form's."""
    from linearize.ops.hybrid.chunk_triton import hybrid_triton_sinks, sinks_settled

    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    qkv = r(b, t, h + 2 * hk, d)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([h, hk, hk], dim=2))
    wq, wk = r(h, d, fh) * 0.5, r(hk, d, fh) * 0.5
    angles = r(1, t, rot // 2) * 3 if rot else None
    rope = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()) if rot else None
    logit = r(h)
    key_mask = _masks(b, t, pad)
    kw = dict(window=window, scale=d ** -0.5, softcap=softcap, key_mask=key_mask)
    rq, rk = (rope_half(q, *rope), rope_half(k, *rope)) if rope is not None else (q, k)
    qf, kf = hedgehog_features(rq, wq), hedgehog_features(rk, wk)
    rule = dict(cache_size=cap, priority="first", anchor=anchor)
    want = ops.sparse_hybrid_attention_naive(rq, rk, qf, kf, v, torch.sigmoid(logit), **kw, **rule)
    assert sinks_settled(key_mask, t, window, cap) == state, "the case's cache is not as meant"
    with torch.no_grad():
        got, got_state = hybrid_triton_sinks(q.float(), k.float(), v.float(), logit.float(), **kw, cache_size=cap,
                                             hedgehog=(wq.float(), wk.float()), logit=True, anchor=anchor,
                                             rope=None if rope is None else tuple(x.float() for x in rope),
                                             output_final_state=state)
    _close(got, want, "y")
    if not state:
        return
    _, want_state = ops.sparse_hybrid_attention_chunked(rq, rk, qf, kf, v, torch.sigmoid(logit), **kw, **rule,
                                                        output_final_state=True)
    for name in ("keys", "key_features", "values", "window_scores", "linear", "cache_keys", "cache_features",
                 "cache_values", "cache_scores"):
        a, e = getattr(got_state, name), getattr(want_state, name)
        assert a.shape == e.shape, (name, a.shape, e.shape)
        _close(a, e, name)
    for name in ("valid", "cache_valid", "cache_pos", "count"):
        assert torch.equal(getattr(got_state, name), getattr(want_state, name)), name
    # the fast decoder's state from it: the fused step's, as from the reference's
    assert ops.FusedSinkState.settled(got_state, "first")
    # and a gradient is refused
    try:
        hybrid_triton_sinks(q.float().requires_grad_(), k.float(), v.float(), logit.float(), **kw, cache_size=cap,
                            hedgehog=(wq.float(), wk.float()), logit=True)
    except ValueError:
        pass
    else:
        raise AssertionError("hybrid_triton_sinks took a tensor that wants a gradient")


# The tiny models of the mixers' checks: one layer (each layer's mixer dispatches alike, and its kernels'
# gradients reach every parameter below it) of 4 query heads over 2 key heads (GQA) of 8 dims
SMALL = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4)


def check_model_sinks(anchor):
    """A tiny converted model with 3 attention sinks (``sparse_priority: "first"``), its mixers on the
    forward kernels (as on CUDA, no gradient) against the PyTorch form: logits of a left-padded batch,
    the prefill's cache (settled) and the next tokens decoded from it; training keeps the PyTorch form."""
    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import tiny_config
    from linearize.cache import LinearizeCache
    from linearize.ops.hybrid import chunk_triton as kernels

    hybrid_module = sys.modules["linearize.ops.hybrid"]
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama", **SMALL))
    model = linearize.convert(teacher, {"kind": "lolcats", "window": 4, "feature_dim": 6, "sparse_cache": 3,
                                        "sparse_priority": "first", "sparse_anchor": anchor})
    ids = torch.randint(2, 97, (2, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    calls = []
    real_rule, real_sinks = hybrid_module.use_hybrid_kernel, kernels.hybrid_triton_sinks

    def as_on_cuda(q, backend="auto", **kw):
        return backend != "torch" and (kw.get("dtype") or q.dtype) in hybrid_module.KERNEL_DTYPES

    def counted(*a, **kw):
        calls.append(kw.get("output_final_state"))
        return real_sinks(*a, **kw)

    def run(on_kernels):
        ops.use_hybrid_kernel = hybrid_module.use_hybrid_kernel = as_on_cuda if on_kernels else real_rule
        kernels.hybrid_triton_sinks = counted
        try:
            with torch.no_grad():
                logits = model(ids, attention_mask=mask, use_cache=False).logits
                cache = LinearizeCache(model)
                model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
                nxt = torch.randint(2, 97, (2, 1), generator=torch.Generator().manual_seed(1))
                step = model(nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1), past_key_values=cache,
                             use_cache=True).logits
            return logits, cache, step
        finally:
            ops.use_hybrid_kernel = hybrid_module.use_hybrid_kernel = real_rule
            kernels.hybrid_triton_sinks = real_sinks

    want, cache_want, step_want = run(False)
    assert not calls
    got, cache_got, step_got = run(True)
    assert calls == [False, True], calls  # scoring, then the prefill with its state
    real = mask.bool()
    _close(got[real], want[real].double(), "logits")
    _close(step_got, step_want.double(), "the next token's logits")
    # training (gradients wanted) keeps the PyTorch form
    calls.clear()
    ops.use_hybrid_kernel = hybrid_module.use_hybrid_kernel = as_on_cuda
    kernels.hybrid_triton_sinks = counted
    try:
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False).loss.backward()
    finally:
        ops.use_hybrid_kernel = hybrid_module.use_hybrid_kernel = real_rule
        kernels.hybrid_triton_sinks = real_sinks
    assert not calls and any(p.grad is not None for n, p in model.named_parameters() if "feature_map" in n)
    for a, e in zip(cache_got.layers, cache_want.layers):
        assert isinstance(a.state, ops.SparseHybridState) and isinstance(e.state, ops.SparseHybridState)
        for x, y in zip(a.state.tensors(), e.state.tensors()):
            if x.is_floating_point():
                _close(x, y.double(), "state")
            else:
                assert torch.equal(x, y)


def check_model(family, feature_map="hedgehog"):
    """A tiny converted model's forward (left padding), gradients of every parameter and prefill
    state, with the mixers dispatching to the kernels (as on CUDA) and to the PyTorch form."""
    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import loss_grads_and_prefill, tiny_config

    hybrid_module = sys.modules["linearize.ops.hybrid"]  # (where hybrid_attention reads use_hybrid_kernel)

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config(family, **SMALL))
    model = linearize.convert(teacher, {"kind": "lolcats", "window": 4, "feature_dim": 6, "feature_map": feature_map})
    ids = torch.randint(2, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the last padding token predicts a real one: its output gets a gradient
    labels = ids.masked_fill(mask == 0, -100)
    calls = []
    real_rule = hybrid_module.use_hybrid_kernel

    def as_on_cuda(q, backend="auto", **kw):  # the dispatch rule of a GPU with backend "fla" (fp32 too)
        calls.append(1)
        return backend != "torch" and (kw.get("dtype") or q.dtype) in hybrid_module.KERNEL_DTYPES

    def run(kernels):
        ops.use_hybrid_kernel = hybrid_module.use_hybrid_kernel = as_on_cuda if kernels else real_rule
        return loss_grads_and_prefill(model, ids, mask, labels)

    want, grads_want, cache_want = run(False)
    got, grads_got, cache_got = run(True)
    assert calls, "the mixers never asked for the kernels"
    real = mask.bool()
    _close(got[real], want[real].double(), "logits")
    assert grads_got.keys() == grads_want.keys() and any("feature_map" in n for n in grads_got)
    for name in grads_want:
        _close(grads_got[name], grads_want[name].double(), name)
    for a, e in zip(cache_got.layers, cache_want.layers):
        if isinstance(e.state, ops.HybridState):
            _compare_state(a.state, e.state.map(lambda x: x.double() if x.is_floating_point() else x))


def check_query_blocks():
    """Query and key programs of half a chunk (``QUERY_ROWS``, ``BWD_QUERY_ROWS``, ``KEY_ROWS`` < the window's tile), as
    the kernels run at a window of 64."""
    from linearize.ops.hybrid import chunk_triton as kernels

    rows, wide = (kernels.QUERY_ROWS, kernels.BWD_QUERY_ROWS, kernels.KEY_ROWS), kernels.WIDE
    kernels.QUERY_ROWS = kernels.BWD_QUERY_ROWS = kernels.KEY_ROWS = 16
    kernels.WIDE = {}  # fp32 inputs take these rows too
    try:
        check_features(2, 2, 1, 50, 16, 16, 32, None, 36, 10)  # 2 chunks of 32 in two blocks each
        check_hedgehog(1, 2, 1, 50, 16, 8, 16, 20, None, 0, 11, alone=False)
    finally:
        (kernels.QUERY_ROWS, kernels.BWD_QUERY_ROWS, kernels.KEY_ROWS), kernels.WIDE = rows, wide


def check_prefill_blocks():
    """The output pass without a backward takes its own tiles (``PREFILL_QUERY_ROWS``): half-chunk query
    programs there while the training pass runs whole chunks, and the other way round; the no-gradient
    output (``check_features``' last check) and the prefill's state stay the reference's. (The backward
    of either training tile is ``check_query_blocks``' and the other cases': no gradients here.)"""
    from linearize.ops.hybrid import chunk_triton as kernels

    saved, wide = (kernels.QUERY_ROWS, kernels.PREFILL_QUERY_ROWS), kernels.WIDE
    kernels.WIDE = {}  # fp32 inputs take these rows too
    try:
        for train_rows, prefill_rows in ((32, 16), (16, 64)):
            kernels.QUERY_ROWS, kernels.PREFILL_QUERY_ROWS = train_rows, prefill_rows
            check_features(2, 2, 1, 50, 16, 16, 32, None, 36, 12, grads=False)  # 2 chunks of 32
    finally:
        (kernels.QUERY_ROWS, kernels.PREFILL_QUERY_ROWS), kernels.WIDE = saved, wide


CASES = {
    # (b, h, hk, t, d, f, window, softcap, pad, seed)
    "gqa": lambda: check_features(1, 4, 2, 9, 8, 6, 4, None, 0, 0),  # GQA, T off the chunks, 3 chunks
    "padding": lambda: check_features(2, 2, 1, 11, 8, 6, 4, 2.0, 7, 1),  # left padding beyond a chunk, softcap
    "short": lambda: check_features(2, 3, 1, 3, 5, 7, 8, None, 1, 2),  # T < window, MQA, odd sizes
    "one": lambda: check_features(1, 2, 2, 1, 8, 4, 4, None, 0, 3),  # T = 1
    "window1": lambda: check_features(1, 2, 1, 5, 8, 4, 1, None, 0, 4),  # a window of one token
    "blocks": check_query_blocks,
    "prefill_blocks": check_prefill_blocks,
    "half": lambda: check_features(1, 4, 2, 20, 16, 16, 8, None, 0, 9, dtype=torch.float16),  # fp16 products
    "exact": lambda: check_features(1, 2, 1, 48, 16, 16, 16, None, 0, 5),  # whole tiles, T a multiple of w
    # the maps' weights' gradients alone in the last two (the same kernels' flags as the first's)
    "hedgehog": lambda: check_hedgehog(2, 4, 2, 9, 8, 5, 8, 4, None, 5, 6, alone=False),  # RoPE over all dims, padding
    "hedgehog_partial": lambda: check_hedgehog(1, 3, 1, 11, 8, 4, 4, 5, 3.0, 0, 7, shared=True),  # half RoPE
    "hedgehog_norope": lambda: check_hedgehog(1, 2, 2, 6, 8, 4, 0, 8, None, 2, 8),  # no RoPE, T < window
    # the mixers' dispatch in tiny models: RoPE over all dims, GQA (llama); soft-capping (gemma2); partial
    # RoPE (gpt_neox); layers without RoPE (smollm3); T2R maps computed in PyTorch
    "model_llama": lambda: check_model("llama"),
    "model_gemma2": lambda: check_model("gemma2"),
    "model_gpt_neox": lambda: check_model("gpt_neox"),
    "model_smollm3": lambda: check_model("smollm3"),
    "model_t2r": lambda: check_model("llama", "t2r"),
    # the first tokens cached (b, h, hk, t, d, fh, rot, window, S, softcap, pad, seed)
    "sinks": lambda: check_sinks(2, 4, 2, 15, 8, 5, 8, 4, 3, None, 6, 12),  # GQA, left padding, RoPE, T off chunks
    "sinks_window": lambda: check_sinks(2, 4, 2, 15, 8, 5, 8, 4, 3, 2.0, 6, 13, anchor="window"),  # softcap
    "sinks_partial": lambda: check_sinks(1, 3, 1, 30, 8, 4, 4, 8, 17, None, 0, 14),  # half RoPE, MQA, S > 16
    "sinks_unsettled": lambda: check_sinks(2, 2, 1, 9, 8, 4, 0, 4, 3, None, 5, 15, state=False),  # no RoPE; 4 real
    "model_sinks": lambda: check_model_sinks("joint"),
    "model_sinks_window": lambda: check_model_sinks("window"),
}

for name in sys.argv[1:] or CASES:
    CASES[name]()
print("ok")
