"""Our Triton kernels against their PyTorch twins on CUDA (skipped elsewhere): the selective scan,
Mamba's fused causal conv1d + SiLU, the LoLCATs decode steps and the fused per-head GroupNorm."""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# (batch, length, channels, state size, with an initial state): StripedMamba's width for SmolLM2 (expand
# 2 x 576), a long sequence off the chunks, and one without a state entering
SCAN_SHAPES = [(2, 300, 1152, 16, True), (1, 2100, 1152, 16, True), (2, 2048, 256, 16, False)]


@pytest.mark.parametrize("shape", SCAN_SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("softplus", [False, True])
def test_triton_scan_equals_torch_scan_on_cuda(softplus, dtype, tol, shape):
    """The Triton scan against the PyTorch chunked form in float64: y, the final state and every gradient;
    with ``softplus``, dt enters before its softplus (``delta_softplus``, as the mixer calls it)."""
    from linearize.ops.selective_scan import selective_scan_chunked
    from linearize.ops.selective_scan_triton import selective_scan_triton

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    b, t, dn, n, with_state = shape
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    dt = r(b, t, dn) - 3.0 if softplus else torch.nn.functional.softplus(r(b, t, dn)) * 0.1
    ins = [r(b, t, dn), dt, -torch.exp(r(dn, n)), r(b, t, n), r(b, t, n), r(dn), r(b, dn, n) * 0.1 if with_state else None]
    w = r(b, t, dn)
    out = {}

    def torch_form(u, dt, *rest, **kw):
        return selective_scan_chunked(u, torch.nn.functional.softplus(dt) if softplus else dt, *rest, **kw, chunk_size=64)

    for name, fn in (("torch", torch_form),
                     ("triton", lambda *a, **k: selective_scan_triton(*a, **k, delta_softplus=softplus))):
        xs = [None if x is None else x.double() if name == "torch" else x.to(dtype) for x in ins]
        xs = [None if x is None else x.detach().requires_grad_(True) for x in xs]
        y, h = fn(*xs[:6], initial_state=xs[6], output_final_state=True)
        assert y.dtype == xs[0].dtype and h.dtype == (torch.float64 if name == "torch" else torch.float32)
        grads = torch.autograd.grad((y.double() * w).sum() + h.double().sum(), [x for x in xs if x is not None])
        out[name] = [y, h, *grads]
    for a, e in zip(out["triton"], out["torch"]):
        assert ((a.double() - e).norm() / e.norm()).item() < tol


@pytest.mark.parametrize("t", [300, 2048])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_causal_conv1d_silu_equals_the_torch_conv_on_cuda(dtype, tol, with_state, t):
    """The fused causal conv1d + SiLU at StripedMamba's width for SmolLM2 (Dn = 1152, K = 4) against
    ``silu(causal_conv1d_naive)`` in float64: y, the final state and the gradients of x (a column slice
    of the input projection's output, as the mixer passes it), weight, bias and initial state."""
    from linearize.ops.causal_conv1d_triton import causal_conv1d_silu_triton
    from linearize.ops.selective_scan import causal_conv1d_naive

    g = torch.Generator(device="cuda").manual_seed(0)
    b, dn, k = 2, 1152, 4
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    ins = [r(b, t, 2 * dn), r(dn, 1, k) * 0.5, r(dn), r(b, dn, k - 1) if with_state else None]
    w_y, w_h = r(b, t, dn).double(), r(b, dn, k - 1).double()

    def torch_form(x, w, bias, initial_state, output_final_state):
        xx = x.transpose(1, 2)
        y = torch.nn.functional.silu(causal_conv1d_naive(xx, w, bias, initial_state=initial_state)).transpose(1, 2)
        past = initial_state if initial_state is not None else xx.new_zeros(b, dn, k - 1)
        return y, torch.cat([past, xx], dim=-1)[..., -(k - 1):]

    out = {}
    for name, fn in (("torch", torch_form), ("triton", causal_conv1d_silu_triton)):
        if name == "torch":
            xs = [None if v is None else v.double() for v in ins]
        else:  # bf16 activations with fp32 parameters and state, as under autocast
            xs = [ins[0].to(dtype), *(None if v is None else v.clone() for v in ins[1:])]
        xs = [None if v is None else v.detach().requires_grad_(True) for v in xs]
        x = xs[0][..., :dn]  # the mixer's column slice: token stride 2 * Dn
        y, h = fn(x, xs[1], xs[2], xs[3], True)
        if name == "triton":
            assert y.dtype == dtype and y.is_contiguous() and h.dtype == torch.float32 and h.shape == (b, dn, k - 1)
        live = [v for v in xs if v is not None]
        grads = torch.autograd.grad((y.double() * w_y).sum() + (h.double() * w_h).sum(), live)
        if name == "triton":
            assert all(gr.dtype == v.dtype for gr, v in zip(grads, live))
        out[name] = [y, h, grads[0][..., :dn], *grads[1:]]
        assert not grads[0][..., dn:].any()
    for i, (a, e) in enumerate(zip(out["triton"], out["torch"])):
        assert ((a.double() - e).norm() / e.norm()).item() < tol, i


def _mixer_case(tiny_model, spec):
    """The second layer's mixer of a tiny Llama converted with ``spec`` (fp32, on CUDA, TF32 off), an
    input ``x [2, 300, 256]`` that wants its gradient, float64 output weights and the trainable parameters."""
    import linearize

    torch.backends.cuda.matmul.allow_tf32 = False
    teacher = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=256).cuda()
    m = linearize.mixers(linearize.convert(teacher, spec))[1]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 300, 256, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(2, 300, 256, device="cuda", generator=g, dtype=torch.float64)
    return m, x, w, [p for p in m.parameters() if p.requires_grad]


# under autocast the PyTorch path rounds the convolution's output to bf16 before its SiLU, the fused
# kernel does not: the two differ by up to ~1.4e-2 (dt_proj's bias, A_log, D) on the CPU interpreter
@pytest.mark.parametrize("autocast,tol", [(False, 1e-4), (True, 3e-2)])
def test_mamba_mixer_with_the_fused_conv_equals_the_torch_path_on_cuda(tiny_model, monkeypatch, autocast, tol):
    """StripedMamba's mixer (fp32 weights, optionally under bf16 autocast as XATL trains) with its
    convolution and SiLU on the fused kernel and on the PyTorch path: output, state and every gradient."""
    from linearize.mixers import mamba

    m, x, w, params = _mixer_case(tiny_model, {"kind": "striped_mamba"})
    m.key_mask = None
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(mamba, "use_fused_conv", lambda xs, key_mask, fused=fused: fused)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y, state = m.mix(x, None, 0, want_state=True)
        grads = torch.autograd.grad((y.double() * w).sum(), [x, *params], allow_unused=True)
        out[fused] = [y, state, *(gr for gr in grads if gr is not None)]
    assert len(out[True]) == len(out[False]) == len(params) + 3
    for a, e in zip(out[True], out[False]):
        assert ((a.double() - e.double()).norm() / e.double().norm()).item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_triton_hybrid_step_equals_the_ring_step_on_cuda(dtype, tol):
    from linearize import ops
    from linearize.ops.hybrid.step_triton import hybrid_step_ring_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, hk, d, f, window, t, n = 4, 9, 3, 64, 128, 64, 100, 80  # SmolLM2's shape, Hedgehog features
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    w_feat = r(d, f // 2) * 0.1
    fmap = lambda x: torch.cat([torch.softmax(x @ w_feat, -1), torch.softmax(-x @ w_feat, -1)], -1)  # noqa: E731
    q, k, v = r(b, h, t + n, d).to(dtype), r(b, hk, t + n, d).to(dtype), r(b, hk, t + n, d).to(dtype)
    xs = [q, k, fmap(q.float()).to(dtype), fmap(k.float()).to(dtype), v]
    gamma = torch.sigmoid(r(h))
    kw = dict(scale=d ** -0.5, softcap=None)
    _, state = ops.hybrid_attention_chunked(*(x[:, :, :t] for x in xs), gamma, window=window, **kw,
                                            output_final_state=True)
    ref = ops.RingHybridState.from_state(state, window, keep_key_features=False)
    mine = ref.map(lambda x: x.clone())
    for i in range(t, t + n):
        qq, kk, qf, _, vv = (x[:, :, i : i + 1] for x in xs)
        want, ref = ops.hybrid_attention_step_ring(qq, kk, qf, None, vv, gamma, ref, **kw,
                                                   key_feature_map=lambda x: fmap(x.float()).to(dtype))
        old = fmap(mine.keys.index_select(2, mine.slot.view(1)).float()).to(dtype)
        got = hybrid_step_ring_triton(qq, kk, qf, vv, gamma, old, mine, **kw)
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() < tol


def _smollm2_step_inputs(dtype, t, n):
    """SmolLM2's decode-step shapes on CUDA (batch 2, 9 / 3 heads of 64, Hedgehog features 2 x 64):
    the maps, strided q/k/v for ``t + n`` tokens, RoPE's cos and sin (shared by the batch) and the draw function."""
    from linearize.mixers.feature_maps import Hedgehog

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, hk, d, fh = 2, 9, 3, 64, 64
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    fq, fk = Hedgehog(h, d, fh).to("cuda", dtype), Hedgehog(hk, d, fh).to("cuda", dtype)
    fq.weight.copy_(r(h, d, fh) * 0.2)
    fk.weight.copy_(r(hk, d, fh) * 0.2)
    q, k, v = (x.transpose(1, 2) for x in r(b, t + n, h + 2 * hk, d).to(dtype).split([h, hk, hk], dim=2))
    angles = torch.arange(t + n, device="cuda")[:, None] * 10000.0 ** (-torch.arange(d // 2, device="cuda") / (d // 2))
    emb = torch.cat([angles, angles], -1)[None]
    return fq, fk, q, k, v, emb.cos().to(dtype), emb.sin().to(dtype), r


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@torch.no_grad()
def test_fused_hybrid_step_equals_rope_features_and_the_ring_step_on_cuda(dtype, tol, splits, softcap):
    from helpers import fused_hybrid_steps

    window, t, n = 64, 100, 80
    fq, fk, q, k, v, cos, sin, r = _smollm2_step_inputs(dtype, t, n)
    b, h = q.shape[:2]
    key_mask = torch.ones(b, t, dtype=torch.bool, device="cuda")
    key_mask[1, : t - window // 2] = False  # left padding: empty slots in the ring
    *steps, (mine, ref) = fused_hybrid_steps(q, k, v, cos, sin, fq, fk, r(h), key_mask, window=window, t=t, n=n,
                                             softcap=softcap, splits=splits)
    for i, (got, want) in enumerate(steps):
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() < tol, i
    assert torch.equal(mine.valid, ref.valid) and torch.equal(mine.slot, ref.slot)
    assert ((mine.ring().linear - ref.linear).norm() / ref.linear.norm()).item() < tol


@pytest.mark.parametrize("anchor", ["joint", "window"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@torch.no_grad()
def test_fused_hybrid_step_with_sinks_equals_the_sparse_ring_step_on_cuda(dtype, tol, splits, anchor):
    from helpers import fused_sink_steps

    window, cap, t, n = 64, 4, 100, 80  # 4 sinks
    fq, fk, q, k, v, cos, sin, r = _smollm2_step_inputs(dtype, t, n)
    b, h = q.shape[:2]
    key_mask = torch.ones(b, t, dtype=torch.bool, device="cuda")
    key_mask[1, :20] = False  # left padding; 80 real tokens: the 4 first have left the window
    *steps, (mine, ref) = fused_sink_steps(q, k, v, cos, sin, fq, fk, r(h), key_mask, window=window, cap=cap, t=t, n=n,
                                           softcap=None, splits=splits, anchor=anchor)
    for i, (got, want) in enumerate(steps):
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() < tol, i
    assert ((mine.ring().linear - ref.linear).norm() / ref.linear.norm()).item() < tol


@pytest.mark.parametrize("decay,normalize", [(False, True), (True, False), (True, True)])
def test_triton_linear_step_equals_the_torch_step_on_cuda(decay, normalize):
    from linearize import ops
    from linearize.ops.linear_step_triton import linear_step_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, hk, f, d = 8, 9, 3, 64, 64
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    log_decay = torch.log1p(-(2.0 ** (-5.0 - torch.arange(h, device="cuda")))) if decay else None
    state = ops.empty_state(b, h, hk, f, d, decay=decay, normalize=normalize, device="cuda")
    mine = state.clone()
    for _ in range(50):
        q, k, v = r(b, h, 1, f).exp() * 0.1, r(b, hk, 1, f).exp() * 0.1, r(b, hk, 1, d)
        want, state = ops.linear_attention_step(q, k, v, state, log_decay=log_decay, normalize=normalize,
                                                backend="torch")
        got, mine = linear_step_triton(q, k, v, mine, log_decay=log_decay, normalize=normalize)
        assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.parametrize("d", [64, 48])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fused_group_norm_gate_equals_the_torch_path_on_cuda(dtype, tol, gated, d):
    """``head_group_norm`` through the fused Triton kernels against its PyTorch path in float64: values and
    the gradients of o, the GroupNorm's weight and bias, and the gate."""
    from linearize.mixers.base import head_group_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, t = 2, 9, 300
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    o = (r(b, t, h, d) * 3 + 1).transpose(1, 2)  # [B, H, T, D] over [B, T, H, D] storage, as fla returns it
    gate = r(b, t, (h + 1) * d)[..., : h * d].view(b, t, h, d).transpose(1, 2) if gated else None  # RetNet's
    norm = torch.nn.GroupNorm(h, h * d, eps=1e-5).cuda()
    with torch.no_grad():
        norm.weight.copy_(1 + r(h * d) * 0.5)
        norm.bias.copy_(r(h * d))
    w = r(b, h, t, d).double()
    out = {}
    for name, dt in (("torch", torch.float64), ("triton", dtype)):
        nm = copy.deepcopy(norm).to(dt)
        xs = [o.to(dt).requires_grad_(True), None if gate is None else gate.to(dt).requires_grad_(True)]
        y = head_group_norm(xs[0], nm, xs[1])
        assert y.dtype == dt and y.shape == (b, h, t, d)
        live = [v for v in (xs[0], nm.weight, nm.bias, xs[1]) if v is not None]
        grads = torch.autograd.grad((y.double() * w).sum(), live)
        assert all(gr.dtype == v.dtype for gr, v in zip(grads, live))
        out[name] = [y, *grads]
    for a, e in zip(out["triton"], out["torch"]):
        assert ((a.double() - e).norm() / e.norm()).item() < tol


@pytest.mark.parametrize("autocast,tol", [(False, 1e-4), (True, 2e-2)])
def test_retnet_mixer_with_the_fused_group_norm_equals_the_torch_path_on_cuda(tiny_model, monkeypatch, autocast, tol):
    """RetNet's mixer (fp32 weights, optionally under bf16 autocast as XATL trains) with its GroupNorm and
    gate on the fused kernels and on the PyTorch path: output and every gradient."""
    import functools

    from linearize.mixers import base, retnet

    m, x, w, params = _mixer_case(tiny_model, {"kind": "retnet", "backend": "torch"})
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(retnet, "head_group_norm", functools.partial(base.head_group_norm, fused=fused))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = m(x)[0]
        grads = torch.autograd.grad((y.double() * w).sum(), [x, *params], allow_unused=True)
        out[fused] = [y, *(gr for gr in grads if gr is not None)]
    assert len(out[True]) == len(out[False]) == len(params) + 2
    for a, e in zip(out[True], out[False]):
        assert ((a.double() - e.double()).norm() / e.double().norm()).item() < tol
