"""The math first: naive = chunked = recurrent in float64, values and gradients, on awkward shapes."""

import pytest
import torch

from helpers import random_grads, run_triton_interpreter_script

from linearize import ops

TOL = 1e-10
# (batch, query heads, key heads, length): MHA, GQA, MQA; lengths off the chunk, shorter, and 1.
SHAPES = [(2, 4, 4, 37), (2, 6, 2, 21), (1, 4, 1, 16), (2, 6, 3, 1), (1, 2, 1, 5)]


def _inputs(b, h, hk, t, f=6, d=5, seed=0, positive=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k = r(b, h, t, f), r(b, hk, t, f)
    if positive:  # feature maps give non-negative features; keep the normaliser away from zero
        q, k = q.exp() * 0.3, k.exp() * 0.3
    v = r(b, hk, t, d)
    for x in (q, k, v):
        x.requires_grad_(True)
    return q, k, v


def _decay(h, kind):
    if kind is None:
        return None
    return torch.log(1 - 2.0 ** (-1 - torch.arange(h, dtype=torch.float64)))  # strong decays stress it


def _close(a, b):
    assert torch.allclose(a, b, atol=TOL, rtol=0), (a - b).abs().max().item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("decay", [None, "on"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("chunk", [4, 8])
def test_linear_attention_forms_agree(shape, decay, normalize, chunk):
    b, h, hk, t = shape
    q, k, v = _inputs(b, h, hk, t)
    ld = _decay(h, decay)
    ref = ops.linear_attention_naive(q, k, v, log_decay=ld, normalize=normalize)
    chunked, s_chunk = ops.linear_attention_chunked(
        q, k, v, log_decay=ld, normalize=normalize, chunk_size=chunk, output_final_state=True)
    rec, s_rec = ops.linear_attention_recurrent(q, k, v, log_decay=ld, normalize=normalize)
    _close(chunked, ref)
    _close(rec, ref)
    _close(s_chunk, s_rec)
    for g_ref, g_chunk, g_rec in zip(random_grads(ref, (q, k, v)), random_grads(chunked, (q, k, v)), random_grads(rec, (q, k, v))):
        _close(g_chunk, g_ref)
        _close(g_rec, g_ref)


@pytest.mark.parametrize("decay", [None, "on"])
@pytest.mark.parametrize("normalize", [True, False])
def test_linear_attention_state_carries_across_splits(decay, normalize):
    """Prefill a prefix, continue from its state: same as one pass (how decoding resumes a prompt)."""
    q, k, v = _inputs(2, 6, 2, 29)
    ld = _decay(6, decay)
    whole, s_whole = ops.linear_attention_chunked(q, k, v, log_decay=ld, normalize=normalize,
                                                  chunk_size=8, output_final_state=True)
    first, s = ops.linear_attention_chunked(q[:, :, :11], k[:, :, :11], v[:, :, :11], log_decay=ld,
                                            normalize=normalize, chunk_size=8, output_final_state=True)
    rest, s_end = ops.linear_attention_chunked(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], log_decay=ld,
                                               normalize=normalize, chunk_size=8, initial_state=s,
                                               output_final_state=True)
    naive_rest = ops.linear_attention_naive(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], log_decay=ld,
                                            normalize=normalize, initial_state=s)
    _close(torch.cat([first, rest], dim=2), whole)
    _close(naive_rest, rest)
    _close(s_end, s_whole)


def test_linear_attention_decay_is_applied():
    """With decay the output differs from the undecayed one, and matches a hand-computed token."""
    q, k, v = _inputs(1, 1, 1, 3, f=2, d=1, positive=False)
    ld = torch.tensor([-0.5], dtype=torch.float64)
    o = ops.linear_attention_naive(q, k, v, log_decay=ld, normalize=False)
    g = torch.exp(ld)
    expect = sum(g ** (2 - s) * (q[0, 0, 2] @ k[0, 0, s]) * v[0, 0, s] for s in range(3))
    _close(o[0, 0, 2], expect)
    assert not torch.allclose(o, ops.linear_attention_naive(q, k, v, normalize=False))


def test_state_is_fp32_for_half_inputs():
    q, k, v = (x.detach().to(torch.bfloat16) for x in _inputs(1, 2, 1, 9))
    _, state = ops.linear_attention_chunked(q, k, v, chunk_size=4, output_final_state=True)
    assert state.dtype == torch.float32
    o, state = ops.linear_attention_recurrent(q, k, v)
    assert state.dtype == torch.float32 and o.dtype == torch.bfloat16


def _hybrid_inputs(b, h, hk, t, d=4, f=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    xs = [r(b, h, t, d), r(b, hk, t, d), r(b, h, t, f).exp() * 0.3, r(b, hk, t, f).exp() * 0.3, r(b, hk, t, d)]
    gamma = torch.sigmoid(r(h))
    for x in xs + [gamma]:
        x.requires_grad_(True)
    return xs, gamma


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [1, 3, 8, 64])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_hybrid_forms_agree(shape, window, softcap):
    b, h, hk, t = shape
    xs, gamma = _hybrid_inputs(b, h, hk, t)
    kw = dict(window=window, scale=0.5, softcap=softcap)
    ref = ops.hybrid_attention_naive(*xs, gamma, **kw)
    chunked, s_chunk = ops.hybrid_attention_chunked(*xs, gamma, **kw, output_final_state=True)
    rec, s_rec = ops.hybrid_attention_recurrent(*xs, gamma, **kw)
    _close(chunked, ref)
    _close(rec, ref)
    for a, b_ in zip((s_chunk.keys, s_chunk.key_features, s_chunk.values, s_chunk.linear),
                     (s_rec.keys, s_rec.key_features, s_rec.values, s_rec.linear)):
        _close(a, b_)
    inputs = (*xs, gamma)
    for g_ref, g_chunk, g_rec in zip(random_grads(ref, inputs), random_grads(chunked, inputs), random_grads(rec, inputs)):
        _close(g_chunk, g_ref)
        _close(g_rec, g_ref)


@pytest.mark.parametrize("form", ["naive", "chunked"])
def test_hybrid_runs_under_bfloat16_autocast(form):
    """Training on the GPU runs under bf16 autocast, where the scores come out bf16: masking must use the
    scores' own dtype (fp32's minimum overflows bf16; seen on the GPU)."""
    xs, gamma = _hybrid_inputs(1, 4, 2, 40)
    ref = ops.hybrid_attention_naive(*xs, gamma, window=8, scale=0.5)
    fn = getattr(ops, f"hybrid_attention_{form}")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(*(x.detach().float() for x in xs), gamma.detach().float(), window=8, scale=0.5)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out.double(), ref.detach(), atol=0.1, rtol=0.05)


def test_hybrid_steps_run_under_bfloat16_autocast():
    """The decode steps (shifting window and ring) under bf16 autocast from a prompt shorter than the
    window: the empty slots are masked with the bf16 scores' own minimum."""
    xs, gamma = _hybrid_inputs(1, 4, 2, 12)
    kw = dict(window=8, scale=0.5)
    ref = ops.hybrid_attention_naive(*xs, gamma, **kw).detach()
    xs, gamma = [x.detach().float() for x in xs], gamma.detach().float()
    _, state = ops.hybrid_attention_chunked(*(x[:, :, :3] for x in xs), gamma, **kw, output_final_state=True)
    ring = ops.RingHybridState.from_state(state, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(3, 12):
            one = [x[:, :, i : i + 1] for x in xs]
            out, state = ops.hybrid_attention_step(*one, gamma, state, **kw)
            out_ring, ring = ops.hybrid_attention_step_ring(*one, gamma, ring, scale=0.5)
            for o in (out, out_ring):
                torch.testing.assert_close(o.double(), ref[:, :, i : i + 1], atol=0.1, rtol=0.05)

def test_hybrid_with_full_window_is_softmax():
    xs, gamma = _hybrid_inputs(2, 6, 2, 19)
    q, k, _, _, v = xs
    out, _ = ops.hybrid_attention_chunked(*xs, gamma, window=19, scale=0.5)
    kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=0.5)
    _close(out, sdpa)


def test_hybrid_prefill_then_steps_equal_one_pass():
    xs, gamma = _hybrid_inputs(2, 4, 2, 23)
    kw = dict(window=5, scale=0.5)
    whole = ops.hybrid_attention_naive(*xs, gamma, **kw)
    first, state = ops.hybrid_attention_chunked(*(x[:, :, :14] for x in xs), gamma, **kw, output_final_state=True)
    rest, _ = ops.hybrid_attention_recurrent(*(x[:, :, 14:] for x in xs), gamma, **kw, initial_state=state)
    _close(torch.cat([first, rest], dim=2), whole)
    assert state.keys.shape[2] == 5  # the decoding state holds exactly the window


def _fake_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, **_):
    """fla's contract ([B, T, H, *] layout, per-head log decay g_gamma), computed by our reference."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    assert v.shape[-1] % 2 == 0, "fla's backward needs an even value width"
    s0 = None if initial_state is None else initial_state.unsqueeze(2)  # [B, H, 1, K, V]
    o, state = ops.linear_attention_chunked(t(q) * scale, t(k), t(v), log_decay=g_gamma, normalize=False,
                                            chunk_size=4, initial_state=s0, output_final_state=output_final_state)
    return t(o), (state.squeeze(2) if state is not None else None)


@pytest.mark.parametrize("decay", [None, "on"])
@pytest.mark.parametrize("normalize", [True, False])
def test_fla_wrapper_layout(monkeypatch, decay, normalize):
    """The fla path's reshaping, GQA repeat, normaliser and state bookkeeping, with the kernel faked."""
    import sys
    import types

    from linearize.ops import fla_backend

    fake = types.ModuleType("fla.ops.simple_gla")
    fake.chunk_simple_gla = _fake_chunk_simple_gla
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", fake)
    q, k, v = _inputs(2, 6, 2, 13, f=4, d=4)
    ld = _decay(6, decay)
    groups = 3 if decay else 1
    s0 = torch.rand(2, 2, groups, 4, 4 + int(normalize), dtype=torch.float64) * 0.1
    ref, ref_state = ops.linear_attention_chunked(q, k, v, log_decay=ld, normalize=normalize, initial_state=s0,
                                                  output_final_state=True)
    out, state = fla_backend.linear_attention_fla(q, k, v, log_decay=ld, normalize=normalize, initial_state=s0,
                                                  output_final_state=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(state, ref_state)


@pytest.mark.parametrize("window", [3, 8])
def test_hybrid_left_padding_is_invisible(window):
    """Padding tokens in front (key_mask False) change no real token's output, in every form."""
    xs, gamma = _hybrid_inputs(2, 4, 2, 19)
    pad = 5
    kw = dict(window=window, scale=0.5)
    key_mask = torch.ones(2, 19, dtype=torch.bool)
    key_mask[1, :pad] = False  # sequence 1 is left-padded
    ref = ops.hybrid_attention_naive(*xs, gamma, **kw, key_mask=key_mask)
    chunked, s_chunk = ops.hybrid_attention_chunked(*xs, gamma, **kw, key_mask=key_mask, output_final_state=True)
    rec, s_rec = ops.hybrid_attention_recurrent(*xs, gamma, **kw, key_mask=key_mask)
    _close(chunked, ref)
    _close(rec, ref)
    for a, b in zip(s_chunk.tensors(), s_rec.tensors()):
        assert torch.equal(a, b) if a.dtype == torch.bool else torch.allclose(a, b, atol=TOL, rtol=0)
    alone = ops.hybrid_attention_naive(*(x[1:, :, pad:] for x in xs), gamma, **kw)
    _close(ref[1:, :, pad:], alone)
    # decoding on from the padded prompt's state equals decoding on from the unpadded one
    nxt, _ = _hybrid_inputs(2, 4, 2, 1, seed=3)
    step_padded, _ = ops.hybrid_attention_step(*(x[1:] for x in nxt), gamma, s_chunk.map(lambda t: t[1:]), **kw)
    _, s_alone = ops.hybrid_attention_chunked(*(x[1:, :, pad:] for x in xs), gamma, **kw, output_final_state=True)
    step_alone, _ = ops.hybrid_attention_step(*(x[1:] for x in nxt), gamma, s_alone, **kw)
    _close(step_padded, step_alone)


def test_triton_hybrid_decode_step_equals_the_ring_step():
    """The fused CUDA kernel of the LoLCATs decode step, run on the CPU by Triton's interpreter."""
    run_triton_interpreter_script("triton_interpret_hybrid.py")


def test_triton_fused_hybrid_decode_step_equals_rope_features_and_the_ring_step():
    """The one-launch LoLCATs decode step (RoPE, Hedgehog maps, window, linear state, bookkeeping),
    run on the CPU by Triton's interpreter: GQA and MQA, left padding, soft-capping, full, partial
    and no RoPE, split value columns, a window of 1; with a cache of the first tokens (attention sinks,
    both anchors) against the sparse cache's ring step."""
    run_triton_interpreter_script("triton_interpret_hybrid_fused.py", "kernel")


def test_fused_step_value_parts_by_batch_and_head_width():
    """The fused step's value parts: added until about ``SPLIT_PROGRAMS`` programs for heads up to 64 wide
    (SmolLM2's 9 heads: 4 parts at batch 1 and 2, none at 4), ``(D / 64)^2`` times as many for wider ones
    (Llama-3-8B's 32 heads of 128: 4 parts at batch 1, none at 4), each part at least 16 columns."""
    pytest.importorskip("triton")
    from linearize.ops.hybrid import step_triton as st

    assert st.SPLIT_PROGRAMS == 32
    assert [st.value_splits(b, 9, 64) for b in (1, 2, 4, 64)] == [4, 2, 1, 1]
    assert [st.value_splits(b, 32, 128) for b in (1, 2, 4, 256)] == [4, 2, 1, 1]
    assert st.value_splits(1, 32, 64) == 1 and st.value_splits(1, 1, 32) == 2  # Llama-3.2-1B; no part under 16
    assert st.value_splits(1, 32, 128, programs=32) == 1


def test_rotates_half_recognises_the_rope_fused_kernels_compute():
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama

    from linearize.models.base import rotates_half

    def interleaved(q, k, cos, sin):  # RoPE on pairs (x0, x1), (x2, x3), ...
        def turn(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([-x2, x1], dim=-1).flatten(-2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + turn(q) * sin, k * cos + turn(k) * sin

    assert rotates_half(llama, 8) and rotates_half(neox, 8) and rotates_half(None, 8)
    assert not rotates_half(interleaved, 8)


def test_rope_rotate_half_is_the_families_rope_bit_for_bit():
    """One tensor through ``rope_rotate_half`` (queries and keys together in SUPRA) gives exactly the
    family's ``apply_rotary_pos_emb``, values and gradients: full and partial rotary, bf16 features
    with fp32 cos/sin (autocast training), either head layout."""
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama

    from linearize.models.base import rope_rotate_half

    g = torch.Generator().manual_seed(0)
    for rotary, r, dtype, trig_dtype in [(llama, 8, torch.float32, torch.float32), (llama, 8, torch.bfloat16, torch.float32),
                                         (neox, 4, torch.float64, torch.float64), (neox, 4, torch.bfloat16, torch.float32)]:
        x = torch.randn(2, 3, 5, 8, generator=g).to(dtype).requires_grad_()
        cos, sin = (torch.randn(2, 5, r, generator=g).to(trig_dtype) for _ in range(2))
        w = torch.randn(2, 3, 5, 8, generator=g)
        want = rotary(x, x, cos, sin)[0]
        for got in (rope_rotate_half(x, cos, sin), rope_rotate_half(x.transpose(1, 2), cos, sin, 2).transpose(1, 2)):
            assert torch.equal(got, want)
            assert torch.equal(*(torch.autograd.grad((y * w).sum(), x, retain_graph=True)[0] for y in (got, want)))


def test_triton_linear_decode_step_equals_the_pytorch_step():
    """The fused CUDA kernel of the linear-attention decode step (normalised or not, decayed or not,
    GQA), run on the CPU by Triton's interpreter."""
    run_triton_interpreter_script("triton_interpret_linear.py")


def test_autocast_hands_the_kernels_half_precision(monkeypatch):
    """Under bf16 autocast, fp32 features (RoPE's fp32 cos/sin make them so) reach fla's kernels in bf16;
    without autocast, or where no kernel applies, the inputs are untouched. (The SUPRA uptraining
    benchmark on an H100 ran the PyTorch chunked form for want of this.)"""
    kernel_dtypes = []

    def fake_use_fla(q, backend, dtype=None):  # the real one wants CUDA; a CPU stand-in with the same dtype rule
        return backend != "torch" and (dtype or q.dtype) in (torch.bfloat16, torch.float16)

    def fake_fla(q, k, v, **kw):
        kernel_dtypes.append((q.dtype, k.dtype, v.dtype))
        return ops.linear_attention_chunked(q, k, v, log_decay=kw["log_decay"], normalize=kw["normalize"])

    monkeypatch.setattr(ops, "use_fla", fake_use_fla)
    monkeypatch.setattr(ops.fla_backend, "use_fla", fake_use_fla)  # what kernel_inputs asks
    monkeypatch.setattr(ops, "linear_attention_fla", fake_fla)
    q, k, v = (torch.rand(1, 2, 8, 4) for _ in range(3))
    decay = torch.full((2,), -0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = ops.linear_attention(q, k, v, log_decay=decay, normalize=False)
        ops.linear_attention(q, k, v, log_decay=decay, normalize=False, backend="torch")
    assert kernel_dtypes == [(torch.bfloat16,) * 3]
    assert o.dtype == torch.bfloat16
    ops.linear_attention(q, k, v, log_decay=decay, normalize=False)  # no autocast: fp32 stays fp32
    assert len(kernel_dtypes) == 1
    assert ops.kernel_inputs(q, k, v)[0] is q
