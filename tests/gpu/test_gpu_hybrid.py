"""The LoLCATs hybrid's whole-sequence Triton kernels (``ops/hybrid/chunk_triton.py``) on CUDA, against the
float64 references: values, gradients and the prefill's state, at SmolLM2's shape (9 query heads on 3
key heads, head dim 64, Hedgehog features 2 x 64, window 64) and off it; and the mixer's dispatch.
Skipped without CUDA."""

import pytest
import torch

from linearize import ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOLS = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# gamma's gradient sums P_t / gamma over every query, terms of both signs: its relative rounding is
# larger than the others' in half precision (fp16 through Triton's interpreter: 1.4e-3 against 5e-4)
GAMMA_TOLS = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}
# In bf16 a fixed bound stands in for what the format allows only at small sizes: at ~1k tokens the
# PyTorch form itself (the same ops in bf16) is that far from float64. There, as flash attention's
# tests do, the kernels pass at <= 2x the PyTorch form's own bf16 error.
TORCH_FACTOR = 2.0


def _err(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-12)).item()


def _padding(b, t, pad):
    if not pad:
        return None
    key_mask = torch.ones(b, t, dtype=torch.bool, device="cuda")
    key_mask[-1, :pad] = False
    return key_mask


def _hedgehog_case(b, h, hk, t, d, fh, window, pad, softcap, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.float64)  # noqa: E731
    qkv = r(b, t, h + 2 * hk, d)  # one projection's output, split as the adapters do
    angles = r(1, t, d // 2) * 3
    rope = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin())
    return qkv, (r(h, d, fh) * 0.3, r(hk, d, fh) * 0.3), rope, torch.sigmoid(r(h)), _padding(b, t, pad), \
        dict(window=window, scale=d ** -0.5, softcap=softcap), r


def _split(qkv, h, hk):
    return tuple(x.transpose(1, 2) for x in qkv.split([h, hk, hk], dim=2))


SHAPES = [  # (b, h, hk, t, pad, softcap)
    (2, 9, 3, 1, 0, None),  # one token
    (2, 9, 3, 37, 5, None),  # shorter than the window, left padding
    (2, 9, 3, 64, 0, None),  # exactly one chunk
    (3, 9, 3, 300, 70, None),  # off the chunks; padding longer than a chunk
    (1, 9, 3, 1024, 0, 30.0),  # many chunks, soft-capping
    (2, 4, 1, 2100, 0, None),  # multi-query, a long one
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_kernels_with_rope_and_hedgehog_equal_the_float64_reference_on_cuda(dtype, shape):
    """RoPE and Hedgehog maps inside the forward kernels (the LoLCATs mixer's path): the output, the
    gradients of the raw q/k/v, both maps' weights and gamma, and the prefill's final state, against
    the rotation, the maps and ``hybrid_attention_naive`` / ``_chunked`` in float64."""
    from linearize.ops.hybrid.chunk_triton import hedgehog_features, hybrid_triton, rope_half

    b, h, hk, t, pad, softcap = shape
    qkv, (wq, wk), rope, gamma, key_mask, kw, r = _hedgehog_case(b, h, hk, t, 64, 64, 64, pad, softcap)
    kw["key_mask"] = key_mask
    w = r(b, h, t, 64)
    if key_mask is not None:
        w = w * key_mask[:, None, :, None]  # a padding query's output is the constant 0

    ref_in = [x.clone().requires_grad_() for x in (qkv, wq, wk, gamma)]
    q, k, v = _split(ref_in[0], h, hk)
    qr, kr = rope_half(q, *rope), rope_half(k, *rope)
    qf, kf = hedgehog_features(qr, ref_in[1]), hedgehog_features(kr, ref_in[2])
    want = ops.hybrid_attention_naive(qr, kr, qf, kf, v, ref_in[3], **kw)
    with torch.no_grad():
        _, want_state = ops.hybrid_attention_chunked(qr, kr, qf, kf, v, ref_in[3], **kw, output_final_state=True)
    grads_want = torch.autograd.grad((want * w).sum(), ref_in)

    mine = [qkv.to(dtype).requires_grad_(), wq.float().requires_grad_(), wk.float().requires_grad_(),
            gamma.float().requires_grad_()]
    mq, mk, mv = _split(mine[0], h, hk)
    got, state = hybrid_triton(mq, mk, mv, mine[3], hedgehog=(mine[1], mine[2]),
                               rope=tuple(x.to(dtype) for x in rope), **kw, output_final_state=True)
    assert got.dtype == dtype and got.shape == want.shape
    tol = TOLS[dtype]
    assert _err(got, want) < tol
    for name in ("keys", "key_features", "values", "linear"):
        assert _err(getattr(state, name), getattr(want_state, name).double()) < tol, name
    assert state.linear.dtype == torch.float32 and torch.equal(state.valid, want_state.valid)
    grads = torch.autograd.grad((got.double() * w).sum(), mine)
    bounds = {name: (GAMMA_TOLS if name == "gamma" else TOLS)[dtype] for name in ("qkv", "wq", "wk", "gamma")}
    if dtype == torch.bfloat16:  # the PyTorch form in bf16 against float64 sets the floor
        low = [qkv.to(dtype).requires_grad_(), wq.to(dtype).requires_grad_(), wk.to(dtype).requires_grad_(),
               gamma.float().requires_grad_()]
        lq, lk, lv = _split(low[0], h, hk)
        lrope = tuple(x.to(dtype) for x in rope)
        lqr, lkr = rope_half(lq, *lrope), rope_half(lk, *lrope)
        ly, _ = ops.hybrid_attention_chunked(lqr, lkr, hedgehog_features(lqr, low[1]), hedgehog_features(lkr, low[2]),
                                             lv, low[3], **kw)
        for name, a, e in zip(bounds, torch.autograd.grad((ly.double() * w).sum(), low), grads_want):
            bounds[name] = max(bounds[name], TORCH_FACTOR * _err(a, e))
    for name, a, e in zip(bounds, grads, grads_want):
        if name == "gamma" and t <= 64:
            assert (a.double() - e).abs().max() < 1e-3  # softmax alone: gamma's gradient is 0
        else:
            assert _err(a, e) < bounds[name], (name, _err(a, e), bounds[name])


@pytest.mark.parametrize("anchor", ["joint", "window"])
@pytest.mark.parametrize("shape", [(2, 9, 3, 300, 70, None), (1, 9, 3, 1024, 0, 30.0), (2, 4, 1, 40, 0, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_on_the_forward_kernels_equal_the_float64_reference_on_cuda(dtype, shape, anchor):
    """``hybrid_triton_sinks`` (the first 4 tokens cached, ``sparse_priority: "first"``): the output and,
    where the cache is settled, the prefill's ``SparseHybridState`` against ``sparse_hybrid_attention_chunked``
    after the rotation and the maps in float64 (in bf16 within the bound or 2x the PyTorch form's own bf16
    error); 40 tokens: the first ones still in the window."""
    from linearize.ops.hybrid.chunk_triton import hedgehog_features, hybrid_triton_sinks, rope_half, sinks_settled

    b, h, hk, t, pad, softcap = shape
    qkv, (wq, wk), rope, gamma, key_mask, kw, r = _hedgehog_case(b, h, hk, t, 64, 64, 64, pad, softcap)
    kw["key_mask"] = key_mask
    rule = dict(cache_size=4, priority="first", anchor=anchor)
    settled = sinks_settled(key_mask, t, 64, 4)
    assert settled == (t > 68)

    def reference(qkv, wq, wk, rope):
        q, k, v = _split(qkv, h, hk)
        qr, kr = rope_half(q, *rope), rope_half(k, *rope)
        qf, kf = hedgehog_features(qr, wq), hedgehog_features(kr, wk)
        return ops.sparse_hybrid_attention_chunked(qr, kr, qf, kf, v, gamma.to(qkv.dtype), **kw, **rule,
                                                   output_final_state=settled)

    with torch.no_grad():
        want, want_state = reference(qkv, wq, wk, rope)
        mq, mk, mv = _split(qkv.to(dtype), h, hk)
        logit = torch.logit(gamma).float()
        got, state = hybrid_triton_sinks(mq, mk, mv, logit, hedgehog=(wq.float(), wk.float()), logit=True,
                                         rope=tuple(x.to(dtype) for x in rope), **kw, cache_size=4, anchor=anchor,
                                         output_final_state=settled)
        bound = TOLS[dtype]
        if dtype == torch.bfloat16:
            low, _ = reference(qkv.to(dtype), wq.to(dtype), wk.to(dtype), tuple(x.to(dtype) for x in rope))
            bound = max(bound, TORCH_FACTOR * _err(low, want))
    assert got.dtype == dtype and _err(got, want) < bound, (_err(got, want), bound)
    if not settled:
        return
    for name in ("keys", "key_features", "values", "linear", "cache_keys", "cache_features", "cache_values"):
        assert _err(getattr(state, name), getattr(want_state, name).double()) < max(bound, TOLS[dtype]), name
    for name in ("valid", "cache_valid", "cache_pos", "count"):
        assert torch.equal(getattr(state, name), getattr(want_state, name)), name
    for name in ("window_scores", "cache_scores"):  # minus positions from the origin
        assert torch.equal(getattr(state, name).double(), getattr(want_state, name).double()), name


@pytest.mark.parametrize("case", [(2, 9, 64, True), (1, 3, 32, False), (2, 3, 0, False)])  # (b, h, R, per-head W)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nope", [False, True], ids=["rope", "nope"])
def test_hedgehog_rope_prelude_kernels_equal_the_float64_reference_on_cuda(dtype, case, nope):
    """The backward's fused prelude (``prelude_triton``): rotated x, features, dx and dW against
    ``rope_half`` + ``hedgehog_features`` + autograd in float64; RoPE over every dim, half of them or
    none, per-head or shared weights, a length off the tiles; the features of the rotated x or (``nope``)
    of x before RoPE."""
    from linearize.ops.hybrid.prelude_triton import hedgehog_rope_backward, hedgehog_rope_forward
    from linearize.ops.hybrid.chunk_triton import hedgehog_features, rope_half

    b, h, rot, per_head = case
    t, d, fh = 300, 64, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.float64)  # noqa: E731
    x = r(b, t, h + 1, d)[:, :, 1:].transpose(1, 2).to(dtype)  # a strided view, as the adapters give q/k
    w = r(h if per_head else 1, d, fh) * 0.3
    cos = sin = None
    if rot:
        angles = r(1, t, rot // 2) * 3
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    d_rot, d_feat = r(b, h, t, d), r(b, h, t, 2 * fh)
    rx, rw = x.double().requires_grad_(), w.clone().requires_grad_()
    xr = rope_half(rx, cos, sin) if rot else rx
    feat = hedgehog_features(rx if nope else xr, rw)
    want_dx, want_dw = torch.autograd.grad([feat, xr], [rx, rw], [d_feat, d_rot])
    fcos, fsin = (None, None) if not rot else (cos.float(), sin.float())
    got_xr, got_feat = hedgehog_rope_forward(x, fcos, fsin, w.float(), nope=nope)
    dx, dw = hedgehog_rope_backward(x, fcos, fsin, w.float(), d_rot.float(), d_feat.float(), nope=nope)
    assert got_feat.dtype == dx.dtype == dtype and dw.dtype == torch.float32 and dw.shape == w.shape
    tol = TOLS[dtype]
    for name, a, e in (("xr", got_xr, xr), ("features", got_feat, feat), ("dx", dx, want_dx), ("dw", dw, want_dw)):
        assert _err(a, e.detach()) < tol, name


@pytest.mark.parametrize("shape", [(2, 9, 3, 300, 70, None), (1, 6, 2, 777, 0, 20.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hybrid_kernels_with_given_features_equal_the_float64_reference_on_cuda(dtype, shape):
    """Features computed outside the kernels (any feature map; here positive random ones of width
    96), through ``ops.hybrid_attention``'s dispatch: output and every gradient."""
    b, h, hk, t, pad, softcap = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.float64)  # noqa: E731
    xs = [r(b, h, t, 64), r(b, hk, t, 64), r(b, h, t, 96).exp() * 0.1, r(b, hk, t, 96).exp() * 0.1, r(b, hk, t, 64),
          torch.sigmoid(r(h))]
    kw = dict(window=64, scale=0.125, softcap=softcap, key_mask=_padding(b, t, pad))
    w = r(b, h, t, 64) * (kw["key_mask"][:, None, :, None] if pad else 1)
    ref_in = [x.clone().requires_grad_() for x in xs]
    want = ops.hybrid_attention_naive(*ref_in, **kw)
    grads_want = torch.autograd.grad((want * w).sum(), ref_in)
    mine = [x.to(dtype).requires_grad_() if i < 5 else x.float().requires_grad_() for i, x in enumerate(xs)]
    backend = "fla" if dtype == torch.float32 else "auto"  # fp32 takes the kernels when asked for
    assert ops.use_hybrid_kernel(mine[0], backend, window=64, head_dim=64, feature_width=96)
    got, _ = ops.hybrid_attention(*mine, **kw, backend=backend)
    assert _err(got, want) < TOLS[dtype]
    grads = torch.autograd.grad((got.double() * w).sum(), mine)
    names = ("q", "k", "qf", "kf", "v", "gamma")
    bounds = {name: (GAMMA_TOLS if name == "gamma" else TOLS)[dtype] for name in names}
    if dtype == torch.bfloat16:  # the PyTorch form in bf16 against float64 sets the floor
        low = [x.detach().clone().requires_grad_() for x in mine]
        ly, _ = ops.hybrid_attention_chunked(*low, **kw)
        for name, a, e in zip(names, torch.autograd.grad((ly.double() * w).sum(), low), grads_want):
            bounds[name] = max(bounds[name], TORCH_FACTOR * _err(a, e))
    for name, a, e in zip(names, grads, grads_want):
        assert _err(a, e) < bounds[name], (name, _err(a, e), bounds[name])


def _student_against_torch_form(spec: dict, t: int, gated: bool = False) -> dict:
    """A tiny LoLCATs student of ``spec`` on CUDA (fp32 weights, ``t`` tokens, left padding) run with ``backend:
    fla`` (the kernels; with ``gated``, each launch with its gates) against ``backend: torch``: logits, every
    parameter's gradient and the prefill's cache; under bf16 autocast "auto" takes the kernels and stays within
    2x the PyTorch form's own bf16 error. Returns the PyTorch form's gradients."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import loss_grads_and_prefill, tiny_config
    from linearize.convert import mixers
    from linearize.ops.hybrid import chunk_triton

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama", hidden_size=96, num_attention_heads=6)).cuda()
    model = linearize.convert(teacher, spec)
    if gated:
        with torch.no_grad():
            for m in mixers(model).values():
                if hasattr(m, "gate_proj"):  # zero at conversion: give the gates something to carry
                    m.gate_proj.weight.normal_(0, 0.3)
    ids = torch.randint(2, 97, (2, t), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    labels = ids.masked_fill(mask == 0, -100)
    calls = []
    launch = chunk_triton.hybrid_triton_forward

    def counted(*a, **kw):
        calls.append(kw.get("log_gate") is not None)
        return launch(*a, **kw)

    def run(backend, autocast=False):
        for m in mixers(model).values():
            m.spec = dataclasses.replace(m.spec, backend=backend)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits, grads, cache = loss_grads_and_prefill(model, ids, mask, labels)
        return logits.float(), grads, cache

    chunk_triton.hybrid_triton_forward = counted
    try:
        got, grads, cache = run("fla")
        assert calls and (all(calls) or not gated), calls
        calls.clear()
        want, grads_want, cache_want = run("torch")
        assert not calls
        half, grads_half, _ = run("auto", autocast=True)
        assert calls and (all(calls) or not gated)
        calls.clear()
        _, grads_half_torch, _ = run("torch", autocast=True)  # the PyTorch form's own bf16 error sets the floor
        assert not calls
    finally:
        chunk_triton.hybrid_triton_forward = launch
    real = mask.bool()
    assert _err(got[real], want[real].double()) < 1e-4
    assert _err(half[real], want[real].double()) < 3e-2
    for name, e in grads_want.items():
        assert _err(grads[name], e.double()) < 1e-3, name
        assert _err(grads_half[name], e.double()) < max(1e-1, TORCH_FACTOR * _err(grads_half_torch[name], e.double())), name
    for a, e in zip(cache.layers, cache_want.layers):
        for x, y in zip(a.state.tensors(), e.state.tensors()):
            assert torch.equal(x, y) if x.dtype == torch.bool else _err(x, y.double()) < 1e-4
    return grads_want


def test_lolcats_mixer_takes_the_kernels_on_cuda_and_matches_the_torch_form():
    """A tiny LoLCATs student on CUDA (fp32 weights, left padding): with ``backend: fla`` (fp32 takes
    the kernels only when asked) its mixers dispatch to the kernels, with logits, every parameter's
    gradient and the prefill's cache equal to the PyTorch form's (``backend: torch``); under bf16
    autocast "auto" takes them in bf16 and stays close."""
    _student_against_torch_form({"kind": "lolcats", "window": 16, "feature_dim": 16}, 77)


# --- gates (issue #46): a fading linear state in the kernels -------------------------------------------------

GATED_SHAPES = [  # (b, h, hk, t, pad, softcap, gates): gates "data" (-softplus, mostly mild), "open" (0), "closed" (-60)
    (2, 9, 3, 1, 0, None, "data"),  # one token
    (2, 9, 3, 37, 5, None, "data"),  # shorter than the window, left padding
    (3, 9, 3, 300, 70, None, "data"),  # off the chunks; padding longer than a chunk
    (1, 9, 3, 1024, 0, 30.0, "data"),  # many chunks, soft-capping
    (2, 4, 1, 2100, 0, None, "data"),  # multi-query, a long one
    (1, 9, 3, 20000, 0, None, "data"),  # 313 chunks: the scans over two tiles of chunks (the decayed carry)
    (2, 9, 3, 300, 70, None, "open"),  # log gates 0: the ungated hybrid
    (2, 9, 3, 300, 0, None, "closed"),  # log gates -60: the window and one linear key
]


def _log_gates(r, b, hk, t, gates):
    if gates == "open":
        return torch.zeros(b, hk, t, device="cuda", dtype=torch.float64)
    if gates == "closed":
        return torch.full((b, hk, t), -60.0, device="cuda", dtype=torch.float64)
    # per key head from strong (horizon ~ 2 tokens) to mild (~ 100): the long-range fades count
    bias = torch.linspace(-1.0, -4.5, hk, device="cuda", dtype=torch.float64)[None, :, None]
    return -torch.nn.functional.softplus(r(b, hk, t) + bias)


@pytest.mark.parametrize("shape", GATED_SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + f"-{s[6]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_hybrid_kernels_with_given_features_equal_the_float64_reference_on_cuda(dtype, shape):
    """Gates through ``ops.hybrid_attention``'s dispatch (features given, as the mixer gives them with
    ``feature_rope: false``; SmolLM2's shape, Hedgehog's width 2 x 64): the output, the prefill's state and
    every gradient, the log gates' included, against ``hybrid_attention_chunked`` with gates in float64
    (in bf16 within the bound or 2x the PyTorch form's own bf16 error); open gates also against the
    ungated kernels."""
    b, h, hk, t, pad, softcap, gates = shape
    g = torch.Generator(device="cuda").manual_seed(2)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.float64)  # noqa: E731
    xs = [r(b, h, t, 64), r(b, hk, t, 64), r(b, h, t, 128).exp() * 0.05, r(b, hk, t, 128).exp() * 0.05,
          r(b, hk, t, 64), torch.sigmoid(r(h)), _log_gates(r, b, hk, t, gates)]
    kw = dict(window=64, scale=0.125, softcap=softcap, key_mask=_padding(b, t, pad))
    w = r(b, h, t, 64) * (kw["key_mask"][:, None, :, None] if pad else 1)
    names = ("q", "k", "qf", "kf", "v", "gamma", "log_gate")

    def chunked(inputs, state=False):
        return ops.hybrid_attention_chunked(*inputs[:6], **kw, log_gate=inputs[6], output_final_state=state)

    ref_in = [x.clone().requires_grad_() for x in xs]
    want, want_state = chunked(ref_in, state=True)
    grads_want = torch.autograd.grad((want * w).sum(), ref_in)
    mine = [x.to(dtype).requires_grad_() if i < 5 else x.float().requires_grad_() for i, x in enumerate(xs)]
    backend = "fla" if dtype == torch.float32 else "auto"
    assert ops.use_hybrid_kernel(mine[0], backend, window=64, head_dim=64, feature_width=128)
    got, state = ops.hybrid_attention(*mine[:6], **kw, backend=backend, log_gate=mine[6], output_final_state=True)
    bound = TOLS[dtype]
    bounds = {name: (GAMMA_TOLS if name in ("gamma", "log_gate") else TOLS)[dtype] for name in names}
    if dtype == torch.bfloat16:  # the PyTorch form in bf16 against float64 sets the floor
        low = [x.detach().clone().requires_grad_() for x in mine]
        ly, _ = chunked(low)
        bound = max(bound, TORCH_FACTOR * _err(ly, want))
        for name, a, e in zip(names, torch.autograd.grad((ly.double() * w).sum(), low), grads_want):
            bounds[name] = max(bounds[name], TORCH_FACTOR * _err(a, e))
    assert got.dtype == dtype and _err(got, want) < bound, (_err(got, want), bound)
    for name in ("keys", "key_features", "values", "linear"):
        assert _err(getattr(state, name), getattr(want_state, name).double()) < max(bound, TOLS[dtype]), name
    assert state.linear.dtype == torch.float32 and torch.equal(state.valid, want_state.valid)
    grads = torch.autograd.grad((got.double() * w).sum(), mine)
    for name, a, e in zip(names, grads, grads_want):
        # a reference gradient that is (numerically) all zero makes _err's relative error meaningless: one
        # token (q's: a softmax over one key), no key out of the window yet (gamma's, the gates'), closed gates
        # (the gates': every fade exp(-60)); there the error is absolute, against gradients of O(1) elsewhere
        if e.abs().max() < 1e-12 or (name in ("gamma", "log_gate") and t <= 64):
            assert (a.double() - e).abs().max() < 1e-3, (name, (a.double() - e).abs().max().item())
        else:
            assert _err(a, e) < bounds[name], (name, _err(a, e), bounds[name])
    if gates == "open":  # the ungated kernels' output and gradients
        plain_in = [x.detach().clone().requires_grad_() for x in mine[:6]]
        plain, _ = ops.hybrid_attention(*plain_in, **kw, backend=backend)
        assert _err(got, plain.double()) < 1e-5 if dtype == torch.float32 else _err(got, plain.double()) < 1e-2
        for name, a, e in zip(names, grads, torch.autograd.grad((plain.double() * w).sum(), plain_in)):
            assert _err(a, e.double()) < (1e-5 if dtype == torch.float32 else 2e-2), name


@pytest.mark.parametrize("shape", [(2, 9, 3, 300, 70, None), (1, 9, 3, 1024, 0, 30.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nope", [False, True], ids=["rope", "nope"])
def test_gated_hybrid_kernels_with_rope_and_hedgehog_equal_the_float64_reference_on_cuda(dtype, shape, nope):
    """Gates with RoPE and Hedgehog maps inside the kernels, the maps of the rotated q/k (``feature_rope``
    on) or of those before RoPE (``nope``): output, state and the gradients of q/k/v, the maps, gamma and
    the log gates."""
    from linearize.ops.hybrid.chunk_triton import hedgehog_features, hybrid_triton, rope_half

    b, h, hk, t, pad, softcap = shape
    qkv, (wq, wk), rope, gamma, key_mask, kw, r = _hedgehog_case(b, h, hk, t, 64, 64, 64, pad, softcap, seed=3)
    kw["key_mask"] = key_mask
    lg = _log_gates(r, b, hk, t, "data")
    w = r(b, h, t, 64) * (key_mask[:, None, :, None] if pad else 1)

    def reference(qkv, wq, wk, gamma, lg, rope):
        q, k, v = _split(qkv, h, hk)
        qr, kr = rope_half(q, *rope), rope_half(k, *rope)
        qx, kx = (q, k) if nope else (qr, kr)
        return ops.hybrid_attention_chunked(qr, kr, hedgehog_features(qx, wq), hedgehog_features(kx, wk), v, gamma,
                                            **kw, log_gate=lg, output_final_state=True)

    ref_in = [x.clone().requires_grad_() for x in (qkv, wq, wk, gamma, lg)]
    want, want_state = reference(*ref_in, rope)
    grads_want = torch.autograd.grad((want * w).sum(), ref_in)
    mine = [qkv.to(dtype).requires_grad_(), *(x.float().requires_grad_() for x in (wq, wk, gamma, lg))]
    mq, mk, mv = _split(mine[0], h, hk)
    got, state = hybrid_triton(mq, mk, mv, mine[3], hedgehog=(mine[1], mine[2]), rope=tuple(x.to(dtype) for x in rope),
                               **kw, log_gate=mine[4], output_final_state=True, nope=nope)
    names = ("qkv", "wq", "wk", "gamma", "log_gate")
    bound = TOLS[dtype]
    bounds = {name: (GAMMA_TOLS if name in ("gamma", "log_gate") else TOLS)[dtype] for name in names}
    if dtype == torch.bfloat16:
        low = [qkv.to(dtype).requires_grad_(), wq.to(dtype).requires_grad_(), wk.to(dtype).requires_grad_(),
               gamma.float().requires_grad_(), lg.float().requires_grad_()]
        ly, _ = reference(*low, tuple(x.to(dtype) for x in rope))
        bound = max(bound, TORCH_FACTOR * _err(ly, want))
        for name, a, e in zip(names, torch.autograd.grad((ly.double() * w).sum(), low), grads_want):
            bounds[name] = max(bounds[name], TORCH_FACTOR * _err(a, e))
    assert _err(got, want) < bound, (_err(got, want), bound)
    for name in ("keys", "key_features", "values", "linear"):
        assert _err(getattr(state, name), getattr(want_state, name).double()) < max(bound, TOLS[dtype]), name
    for name, a, e in zip(names, torch.autograd.grad((got.double() * w).sum(), mine), grads_want):
        assert _err(a, e) < bounds[name], (name, _err(a, e), bounds[name])


@pytest.mark.parametrize("option", [{"feature_rope": False, "decay": "gated"}, {"decay": "gated"}, {"decay": "span"},
                                    {"feature_rope": False, "decay": "learned"}],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_gated_lolcats_mixer_takes_the_kernels_on_cuda_and_matches_the_torch_form(option):
    """A tiny LoLCATs student with the length options on CUDA (fp32 weights, left padding): with ``backend:
    fla`` its mixers run the kernels with their gates, with logits, every parameter's gradient (the gates'
    projection and bias among them) and the prefill's cache equal to the PyTorch form's; under bf16
    autocast "auto" takes them in bf16 and stays within 2x the PyTorch form's own bf16 error."""
    grads_want = _student_against_torch_form({"kind": "lolcats", "window": 16, "feature_dim": 16, "decay_horizon": 32,
                                              **option}, 150, gated=True)
    assert option["decay"] == "span" or any("gate_bias" in n for n in grads_want)  # (a span is fixed)
