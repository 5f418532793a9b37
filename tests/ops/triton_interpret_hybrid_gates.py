"""Run by test_hybrid_chunk_triton.py in a subprocess, on the CPU through Triton's interpreter: the hybrid's
whole-sequence kernels (``ops/hybrid/chunk_triton.py``) with gates (``log_gate``: a fading linear state)
against ``hybrid_attention_chunked`` with gates in float64: values, the prefill's final state and the
gradients of q, k, v, the features (or Hedgehog weights), gamma and the log gates.

``ARGS`` picks the cases (all by default)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from linearize import ops  # noqa: E402
from linearize.ops.hybrid import chunk_triton as kernels  # noqa: E402
from linearize.ops.hybrid.chunk_triton import hedgehog_features, hybrid_triton, rope_half  # noqa: E402

TOL = 2e-5
NAMES = ("q", "k", "v", "qf", "kf", "gamma", "log_gate")


def _close(got, want, what, floor=1e-6, tol=TOL):
    """Largest error relative to the largest reference entry (at least ``floor``)."""
    err = ((got.double() - want).abs().max() / want.abs().max().clamp_min(floor)).item()
    assert err < tol, (what, err)


def _mask(b, t, pad, hole=False):
    """The last sequence left-padded by ``pad``; ``hole``: the first one misses two tokens in the middle."""
    if not pad and not hole:
        return None
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[-1, :pad] = False
    if hole:
        key_mask[0, t // 2 : t // 2 + 2] = False
    return key_mask


def _inputs(b, h, hk, t, d, f, seed, strength):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(b, h, t, d), r(b, hk, t, d), r(b, hk, t, d)
    qf, kf = r(b, h, t, f).exp() * 0.3, r(b, hk, t, f).exp() * 0.3
    gamma = torch.sigmoid(r(h))
    if isinstance(strength, float):
        log_gate = -strength * torch.nn.functional.softplus(r(b, hk, t))  # data-dependent, <= 0
    else:  # a constant log gate
        log_gate = torch.full((b, hk, t), float(strength[0]), dtype=torch.float64)
    return (q, k, v, qf, kf, gamma, log_gate), g


def _weights(want, key_mask, g):
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    return w if key_mask is None else w * key_mask[:, None, :, None]  # a padding query's output is the constant 0


def _reference(q, k, v, qf, kf, gamma, log_gate, **kw):
    return ops.hybrid_attention_chunked(q, k, qf, kf, v, gamma, **kw, log_gate=log_gate, output_final_state=True)


def _compare_state(got, want):
    for name in ("keys", "key_features", "values", "linear"):
        a, e = getattr(got, name), getattr(want, name)
        assert a.shape == e.shape, (name, a.shape, e.shape)
        _close(a, e, name)
    assert got.linear.dtype == torch.float32 and torch.equal(got.valid, want.valid)


def check(b, h, hk, t, d, f, window, softcap=None, pad=0, seed=0, strength=1.0, hole=False, dtype=torch.float32,
          extras=False):
    """Features given (``ops.hybrid_attention``'s path): output, state and every gradient; with ``extras``
    also the output without gradients and the gradient of the log gates alone (the rest frozen, as in
    LoLCATs' stage 1)."""
    xs, g = _inputs(b, h, hk, t, d, f, seed, strength)
    key_mask = _mask(b, t, pad, hole)
    kw = dict(window=window, scale=d ** -0.5, softcap=softcap, key_mask=key_mask)
    if dtype != torch.float32:  # the reference from the inputs as rounded
        xs = tuple(x.to(dtype).double() if i < 5 else x for i, x in enumerate(xs))
    ref_in = [x.clone().requires_grad_() for x in xs]
    want, want_state = _reference(*ref_in, **kw)
    mine = [x.to(dtype if i < 5 else torch.float32).requires_grad_() for i, x in enumerate(xs)]
    mq, mk, mv, mqf, mkf, mg, mlg = mine
    got, state = hybrid_triton(mq, mk, mv, mg, qf=mqf, kf=mkf, **kw, log_gate=mlg, output_final_state=True)
    tol = {torch.float32: TOL, torch.float16: 2e-3}[dtype]
    assert got.shape == want.shape and got.dtype == dtype
    _close(got, want, "y", tol=tol)
    if dtype == torch.float32:
        _compare_state(state, want_state)
    w = _weights(want, key_mask, g)
    grads_want = torch.autograd.grad((want * w).sum(), ref_in)
    grads_got = torch.autograd.grad((got.double() * w).sum(), mine)
    for name, a, e in zip(NAMES, grads_got, grads_want):
        assert a.dtype == (dtype if name in NAMES[:5] else torch.float32), name
        # gamma's and the gates' gradients are 0 where no key has left the window: an absolute floor
        floor = 1.0 if name in ("gamma", "log_gate") else 1e-6
        _close(a, e, "d" + name, floor=floor, tol=tol * (5 if name in ("gamma", "log_gate") else 1))
    if not extras:
        return got, state, grads_got
    with torch.no_grad():
        again, _ = hybrid_triton(*(x.detach() for x in (mq, mk, mv, mg)), qf=mqf.detach(), kf=mkf.detach(), **kw,
                                 log_gate=mlg.detach())
    _close(again, want, "y (no grad)", tol=tol)
    alone = mlg.detach().requires_grad_()
    got2, _ = hybrid_triton(*(x.detach() for x in (mq, mk, mv, mg)), qf=mqf.detach(), kf=mkf.detach(), **kw,
                            log_gate=alone)
    (dlg,) = torch.autograd.grad((got2.double() * w).sum(), [alone])
    _close(dlg, grads_want[6], "dlog_gate alone", floor=1.0, tol=tol * 5)
    return got, state, grads_got


def check_open():
    """Log gates of 0 (no fade): the float64 reference's values and gradients (the gates' among them,
    not 0 there), and the ungated kernels' values, state and gradients."""
    check(2, 2, 1, 9, 8, 6, 4, pad=3, seed=3, strength=(0.0,))
    xs, g = _inputs(2, 2, 1, 9, 8, 6, 3, (0.0,))
    key_mask = _mask(2, 9, 3)
    kw = dict(window=4, scale=8 ** -0.5, key_mask=key_mask, output_final_state=True)
    outs = []
    for gated in (True, False):
        mine = [x.float().requires_grad_() for x in xs[:6]]
        y, state = hybrid_triton(*mine[:3], mine[5], qf=mine[3], kf=mine[4], **kw,
                                 log_gate=xs[6].float() if gated else None)
        outs.append((y, state, mine))
    (y, state, mine), (plain, plain_state, plain_in) = outs
    _close(y, plain.double(), "y open = ungated", tol=1e-6)
    _close(state.linear, plain_state.linear.double(), "state open = ungated", tol=1e-6)
    w = _weights(plain.double(), key_mask, g)
    for name, a, e in zip(NAMES, torch.autograd.grad((y.double() * w).sum(), mine),
                          torch.autograd.grad((plain.double() * w).sum(), plain_in)):
        _close(a, e.double(), "d" + name + " open = ungated", floor=1.0 if name == "gamma" else 1e-6, tol=1e-6)


def check_closed():
    """Strongly negative log gates (-60 a token): only the key that left the window this very step
    stays in the linear state (the reference's form); the gates' gradient is then ~0."""
    check(1, 4, 2, 9, 8, 6, 4, seed=4, strength=(-60.0,))


def check_closed_half():
    """Closed gates with 16-bit products (fp16 stands in for bf16, which the interpreter multiplies wrongly):
    the gates' gradient is ~0 only if each query's phi_q . dphi_q and each key's phi_k . dphi_k, whose pairs
    cancel in ``log_gate_grad``, round alike. With the key side's from dkf (its 16-bit operand) it was 8.7e-4
    here (0.054 in bf16 on an H200, at SmolLM2's shape), from fp32 terms as the query side's 4e-26."""
    _, _, grads = check(1, 4, 2, 17, 8, 6, 4, seed=4, strength=(-60.0,), dtype=torch.float16)
    err = grads[6].abs().max().item()
    assert err < 1e-5, ("dlog_gate, closed gates in fp16", err)


def check_chunks_per_tile():
    """The scans' tiles of fewer chunks (``SCAN_CHUNKS`` = 2; 5 chunks: a last tile of one): the decayed
    carry from tile to tile, forward and in reverse, and the final state from a later tile."""
    saved = kernels.SCAN_CHUNKS
    try:
        kernels.SCAN_CHUNKS = 2
        check(2, 2, 1, 9, 8, 6, 2, pad=5, seed=5, strength=0.3)
    finally:
        kernels.SCAN_CHUNKS = saved


def check_query_blocks():
    """Query and key programs of half a chunk (``QUERY_ROWS``, ``BWD_QUERY_ROWS``, ``KEY_ROWS`` < the
    window's tile) and the prefill's own rows, as at a window of 64."""
    rows, wide = (kernels.QUERY_ROWS, kernels.BWD_QUERY_ROWS, kernels.KEY_ROWS, kernels.PREFILL_QUERY_ROWS), kernels.WIDE
    kernels.QUERY_ROWS = kernels.BWD_QUERY_ROWS = kernels.KEY_ROWS = kernels.PREFILL_QUERY_ROWS = 16
    kernels.WIDE = {}  # fp32 inputs take these rows too
    try:
        check(1, 2, 1, 50, 16, 16, 32, pad=0, seed=6, strength=0.2)  # 2 chunks of 32 in two blocks each
    finally:
        (kernels.QUERY_ROWS, kernels.BWD_QUERY_ROWS, kernels.KEY_ROWS, kernels.PREFILL_QUERY_ROWS), kernels.WIDE = rows, wide


def check_hedgehog(b, h, hk, t, d, fh, rot, window, softcap, pad, seed, fused=True, nope=False, gated=True):
    """Gates with RoPE and Hedgehog maps inside the kernels, of the rotated q/k or (``nope``,
    ``feature_rope`` off) of those before RoPE: values, the prefill's state and the gradients of the raw
    q/k/v, the maps' weights, gamma (as logits) and the log gates (``gated``; else no gates); the
    backward's prelude in Triton (``fused``) or PyTorch."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(b, h, t, d), r(b, hk, t, d), r(b, hk, t, d)
    wq, wk = r(h, d, fh) * 0.5, r(hk, d, fh) * 0.5
    angles = r(1, t, rot // 2) * 3
    rope = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin())
    logit = r(h)
    log_gate = -torch.nn.functional.softplus(r(b, hk, t))
    key_mask = _mask(b, t, pad)
    kw = dict(window=window, scale=d ** -0.5, softcap=softcap, key_mask=key_mask)

    def reference(q, k, v, wq, wk, logit, log_gate=None):
        qr, kr = rope_half(q, *rope), rope_half(k, *rope)
        qx, kx = (q, k) if nope else (qr, kr)
        return _reference(qr, kr, v, hedgehog_features(qx, wq), hedgehog_features(kx, wk), torch.sigmoid(logit),
                          log_gate, **kw)

    inputs = (q, k, v, wq, wk, logit, log_gate)[: 7 if gated else 6]
    ref_in = [x.clone().requires_grad_() for x in inputs]
    want, want_state = reference(*ref_in)
    mine = [x.float().requires_grad_() for x in inputs]
    saved = kernels.FUSED_PRELUDE
    kernels.FUSED_PRELUDE = fused
    try:
        got, state = hybrid_triton(*mine[:3], mine[5], hedgehog=(mine[3], mine[4]),
                                   rope=tuple(x.float() for x in rope), **kw, log_gate=mine[6] if gated else None,
                                   logit=True, output_final_state=True, nope=nope)
        _close(got, want, "y")
        _compare_state(state, want_state)
        w = _weights(want, key_mask, g)
        grads_want = torch.autograd.grad((want * w).sum(), ref_in)
        for name, a, e in zip(("q", "k", "v", "wq", "wk", "gamma", "log_gate"),
                              torch.autograd.grad((got.double() * w).sum(), mine), grads_want):
            _close(a, e, "d" + name, floor=1.0 if name in ("gamma", "log_gate") else 1e-6)
    finally:
        kernels.FUSED_PRELUDE = saved


def check_sinks_refused():
    xs, _ = _inputs(1, 2, 1, 12, 8, 4, 0, 1.0)
    q, k, v = (x.float() for x in xs[:3])
    wq, wk = torch.randn(2, 8, 2), torch.randn(1, 8, 2)
    for call in (lambda: kernels.hybrid_triton_sinks(q, k, v, torch.zeros(2), window=4, cache_size=2, scale=0.3,
                                                     hedgehog=(wq, wk), log_gate=xs[6].float()),
                 lambda: kernels.hybrid_triton_forward(q, k, v, torch.zeros(2), window=4, scale=0.3, hedgehog=(wq, wk),
                                                       sinks=(torch.zeros(1, 12, dtype=torch.int32),
                                                              torch.zeros(1, 2, dtype=torch.int32)),
                                                       log_gate=xs[6].float())):
        try:
            call()
        except ValueError as e:
            assert "gates" in str(e), e
        else:
            raise AssertionError("the sinks' kernels took gates")


def check_model(spec):
    """A tiny converted model with a fading state (``spec``), its mixers dispatching to the kernels (as
    on CUDA) and to the PyTorch form: logits of a left-padded batch, every parameter's gradient (the
    gates' projection and bias among them) and the prefill's cache."""
    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import loss_grads_and_prefill, tiny_config

    hybrid_module = sys.modules["linearize.ops.hybrid"]
    torch.manual_seed(0)
    # one layer (each layer's mixer dispatches alike, and its kernels' gradients reach every parameter below
    # it) of 4 query heads over 2 key heads (GQA) of 8 dims
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=1, hidden_size=32,
                                                           num_attention_heads=4))
    model = linearize.convert(teacher, {"kind": "lolcats", "window": 4, "feature_dim": 6, **spec})
    if spec.get("decay") == "gated":  # the gates' projection starts at zero: give it something to carry
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "gate_proj" in name:
                    p.normal_(0, 0.3)
    ids = torch.randint(2, 97, (2, 10), generator=torch.Generator().manual_seed(0))  # 3 chunks of the window
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    calls = []
    real_rule, real_kernels = hybrid_module.use_hybrid_kernel, kernels.hybrid_triton

    def as_on_cuda(q, backend="auto", **kw):  # the dispatch rule of a GPU with backend "fla" (fp32 too)
        return backend != "torch" and (kw.get("dtype") or q.dtype) in hybrid_module.KERNEL_DTYPES

    def counted(*a, **kw):  # (gates given, Hedgehog maps in the kernels, features before RoPE)
        calls.append((kw.get("log_gate") is not None, kw.get("hedgehog") is not None, bool(kw.get("nope"))))
        return real_kernels(*a, **kw)

    def run(on_kernels):
        ops.use_hybrid_kernel = hybrid_module.use_hybrid_kernel = as_on_cuda if on_kernels else real_rule
        kernels.hybrid_triton = counted
        try:
            return loss_grads_and_prefill(model, ids, mask, labels)
        finally:
            ops.use_hybrid_kernel = hybrid_module.use_hybrid_kernel = real_rule
            kernels.hybrid_triton = real_kernels

    want, grads_want, cache_want = run(False)
    assert not calls
    got, grads_got, cache_got = run(True)
    # every layer's sequence on the kernels, with its gates and the Hedgehog maps inside them
    assert calls and set(calls) == {(True, True, spec.get("feature_rope") is False)}, calls
    real = mask.bool()
    _close(got[real], want[real].double(), "logits")
    assert grads_got.keys() == grads_want.keys() and any("gate_bias" in n for n in grads_got)
    for name in grads_want:
        _close(grads_got[name], grads_want[name].double(), name)
    for a, e in zip(cache_got.layers, cache_want.layers):
        _compare_state(a.state, e.state.map(lambda x: x.double() if x.is_floating_point() else x))


CASES = {
    # (b, h, hk, t, d, f, window, softcap, pad, seed)
    "gqa": lambda: check(1, 4, 2, 9, 8, 6, 4, None, 0, 0, extras=True),  # GQA, T off the chunks, 3 chunks
    # MQA, left padding longer than a chunk, a hole, soft-capping
    "padding": lambda: check(2, 2, 1, 11, 8, 6, 4, 2.0, 7, 1, hole=True, extras=True),
    "short": lambda: check(2, 3, 1, 3, 5, 7, 8, None, 1, 2),  # T < window, odd sizes
    "window1": lambda: check(1, 2, 1, 5, 8, 4, 1, None, 0, 7),  # a window of one token
    "exact": lambda: check(1, 2, 1, 48, 16, 16, 16, None, 0, 8, strength=0.1),  # whole tiles, T a multiple of w
    "half": lambda: check(1, 4, 2, 20, 16, 16, 8, None, 0, 9, strength=0.3, dtype=torch.float16),  # fp16 products
    "open": check_open,
    "closed": check_closed,
    "closed_half": check_closed_half,
    "scan_tiles": check_chunks_per_tile,
    "blocks": check_query_blocks,
    "hedgehog": lambda: check_hedgehog(2, 4, 2, 9, 8, 5, 8, 4, None, 5, 10),
    "hedgehog_torch_prelude": lambda: check_hedgehog(1, 2, 1, 14, 8, 4, 4, 4, 3.0, 0, 11, fused=False),
    # features before RoPE (feature_rope off) in the kernels: gated and not, partial RoPE, both preludes
    "nope": lambda: check_hedgehog(2, 4, 2, 9, 8, 5, 8, 4, None, 5, 12, nope=True),
    "nope_partial": lambda: check_hedgehog(1, 2, 1, 14, 8, 4, 4, 4, 3.0, 0, 13, nope=True, gated=False),
    "nope_torch_prelude": lambda: check_hedgehog(2, 3, 1, 11, 8, 4, 8, 4, None, 2, 14, fused=False, nope=True),
    "sinks_refused": check_sinks_refused,
    # the LoLCATs mixer's dispatch: features of the q/k before RoPE with data-dependent gates, and a learned
    # decay, each with Hedgehog maps and RoPE in the kernels
    "model_gated": lambda: check_model({"feature_rope": False, "decay": "gated"}),
    "model_learned": lambda: check_model({"decay": "learned"}),
}

for name in sys.argv[1:] or CASES:
    CASES[name]()
print("ok")
