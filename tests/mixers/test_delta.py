"""The gated delta rule and its window hybrid: the forms agree in float64 (values, gradients, states),
padding is invisible, fla's kernel is wrapped right (faked here, real on CUDA), and the ``delta``
mixer converts, decodes, saves and trains on a tiny model."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

import linearize
from helpers import (assert_decodes_like_parallel, assert_fast_equals_generate, plain_generate, random_grads,
                     run_triton_interpreter_script, tiny_student, tiny_tokenizer)
from linearize import ops
from linearize.cache import LinearizeCache, cache_nbytes
from linearize.info import state_bytes

TOL = 1e-10
SHAPES = [(2, 4, 2, 37), (1, 6, 3, 16), (2, 2, 2, 5), (1, 3, 1, 1)]


def _close(a, b):
    assert torch.allclose(a, b, atol=TOL, rtol=0), (a - b).abs().max().item()


def _gdn_inputs(b, h, hk, t, kd=5, vd=4, seed=0, device="cpu", dtype=torch.float64):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
    xs = [F.normalize(r(b, h, t, kd), dim=-1), F.normalize(r(b, hk, t, kd), dim=-1), r(b, hk, t, vd),
          -F.softplus(r(b, hk, t)), torch.sigmoid(r(b, hk, t))]
    return [x.requires_grad_(True) for x in xs]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk", [4, 16])
def test_gated_delta_rule_forms_agree(shape, chunk):
    xs = _gdn_inputs(*shape)
    s0 = torch.randn(shape[0], shape[2], 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) * 0.1
    ref, s_ref = ops.gated_delta_rule_naive(*xs, initial_state=s0)
    chunked, s_chunk = ops.gated_delta_rule_chunked(*xs, chunk_size=chunk, initial_state=s0, output_final_state=True)
    steps, state = [], s0
    for i in range(shape[3]):
        o, state = ops.gated_delta_rule_step(*(x[:, :, i : i + 1] for x in xs), state)
        steps.append(o)
    _close(chunked, ref)
    _close(torch.cat(steps, dim=2), ref)
    _close(s_chunk, s_ref)
    _close(state, s_ref)
    for g_ref, g_chunk in zip(random_grads(ref, xs), random_grads(chunked, xs)):
        _close(g_chunk, g_ref)


def test_delta_rule_overwrites_what_a_key_holds():
    """The delta rule's point: writing v2 under the key that held v1 (b = 1, no decay) replaces v1,
    where additive linear attention would return v1 + v2."""
    k = F.normalize(torch.randn(1, 1, 1, 4, dtype=torch.float64), dim=-1).expand(1, 1, 2, 4)
    v = torch.tensor([[[[1.0, 2.0], [-3.0, 5.0]]]], dtype=torch.float64)
    o, _ = ops.gated_delta_rule_naive(k, k, v, torch.zeros(1, 1, 2, dtype=torch.float64),
                                      torch.ones(1, 1, 2, dtype=torch.float64))
    _close(o[0, 0, 1], v[0, 0, 1])


def _hybrid_inputs(b, h, hk, t, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    xs = [r(b, h, t, d), r(b, hk, t, d), F.normalize(r(b, h, t, d), dim=-1), F.normalize(r(b, hk, t, d), dim=-1),
          r(b, hk, t, d), -F.softplus(r(b, hk, t)), torch.sigmoid(r(b, hk, t)), torch.sigmoid(r(b, h, t))]
    return [x.requires_grad_(True) for x in xs]


def _cut(xs, sl):
    return [x[..., sl] if x.dim() == 3 else x[:, :, sl] for x in xs]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_hybrid_forms_agree(shape, window):
    xs = _hybrid_inputs(*shape)
    kw = dict(window=window, scale=0.5, softcap=2.0 if window == 3 else None)
    ref = ops.delta_window_naive(*xs, **kw)
    chunked, s_chunk = ops.delta_window_chunked(*xs, **kw, chunk_size=4, output_final_state=True)
    rec, s_rec = ops.delta_window_recurrent(*xs, **kw)
    _close(chunked, ref)
    _close(rec, ref)
    for a, b in zip(s_chunk.tensors(), s_rec.tensors()):
        assert torch.equal(a, b) if a.dtype == torch.bool else torch.allclose(a, b, atol=TOL, rtol=0)
    for g_ref, g_chunk, g_rec in zip(random_grads(ref, xs), random_grads(chunked, xs), random_grads(rec, xs)):
        _close(g_chunk, g_ref)
        _close(g_rec, g_ref)


@pytest.mark.parametrize("window", [1, 3, 8, 17, 40])
def test_the_window_softmax_as_sdpa_on_blocks_equals_the_definition(monkeypatch, window):
    """``WINDOW_SDPA`` (CUDA's path): SDPA on blocks of 16 or 48 queries (a block reaching back exactly one
    block at window 17, one block covering the sequence at 40) gives the hybrid's outputs and gradients, with
    GQA, left padding and a padding token inside a sequence (its own row is never empty)."""
    from linearize.ops import window as delta_rule

    xs = _hybrid_inputs(3, 4, 2, 22, seed=3)
    mask = torch.ones(3, 22, dtype=torch.bool)
    mask[1, :5] = False
    mask[2, 14] = False
    kw = dict(window=window, scale=0.5)
    ref = ops.delta_window_naive(*xs, **kw, key_mask=mask)
    monkeypatch.setattr(delta_rule, "WINDOW_SDPA", True)
    got, _ = ops.delta_window_chunked(*xs, **kw, key_mask=mask, chunk_size=4)
    assert not got.isnan().any()
    _close(got, ref)
    for g_got, g_ref in zip(random_grads(got, xs), random_grads(ref, xs)):
        _close(g_got, g_ref)
    assert not delta_rule._use_window_sdpa(xs[0], softcap=2.0)  # soft-capped scores keep the chunked form
    monkeypatch.setattr(delta_rule, "WINDOW_SDPA", "auto")
    assert delta_rule._use_window_sdpa(xs[0], softcap=None)  # "auto": on any device
    monkeypatch.setattr(delta_rule, "WINDOW_SDPA", False)
    assert not delta_rule._use_window_sdpa(xs[0], softcap=None)


def test_window_hybrid_padding_is_invisible_and_decoding_resumes_anywhere():
    xs = _hybrid_inputs(3, 4, 2, 22, seed=2)
    mask = torch.ones(3, 22, dtype=torch.bool)
    mask[1, :5] = False
    mask[2, :10] = False
    mask[2, 14] = False
    kw = dict(window=3, scale=0.5)
    ref = ops.delta_window_naive(*xs, **kw, key_mask=mask)
    _close(ops.delta_window_chunked(*xs, **kw, key_mask=mask, chunk_size=4)[0], ref)
    _close(ops.delta_window_recurrent(*xs, **kw, key_mask=mask)[0], ref)
    alone = ops.delta_window_naive(*(x[1:2] for x in _cut(xs, slice(5, None))), **kw)
    _close(ref[1:2, :, 5:], alone)
    for cut in (1, 7, 11, 16, 21):
        _, state = ops.delta_window_chunked(*_cut(xs, slice(None, cut)), **kw, key_mask=mask[:, :cut],
                                            output_final_state=True, chunk_size=4)
        rest, _ = ops.delta_window_recurrent(*_cut(xs, slice(cut, None)), **kw, initial_state=state,
                                             key_mask=mask[:, cut:])
        _close(rest, ref[:, :, cut:])


@pytest.mark.parametrize("t,window", [(3, 8), (8, 8), (13, 4), (1, 1)])
def test_ring_step_is_the_step_in_place(t, window):
    """The fast decoder's ring of w slots gives the shifting window's outputs token after token (GQA,
    soft-capping, left padding in the prompt, prompts shorter than, equal to and longer than the
    window), in the same buffers every step, and ends with the same memory."""
    n = 12
    xs = [x.detach() for x in _hybrid_inputs(3, 4, 2, t + n, seed=3)]
    mask = torch.ones(3, t, dtype=torch.bool)
    mask[1, : t // 2] = False
    mask[2, :-1] = False  # one real token
    kw = dict(scale=0.5, softcap=2.0)
    _, state = ops.delta_window_chunked(*_cut(xs, slice(None, t)), window=window, **kw, key_mask=mask,
                                        output_final_state=True, chunk_size=4)
    ring = ops.RingDeltaState.from_state(state.map(torch.clone), window)
    buffers = [x.data_ptr() for x in ring.tensors()]
    assert ring.keys.shape[2] == window
    for i in range(t, t + n):
        one = _cut(xs, slice(i, i + 1))
        ref, state = ops.delta_window_step(*one, state, window=window, **kw)
        out, ring = ops.delta_window_step_ring(*one, ring, **kw)
        _close(out, ref)
    assert [x.data_ptr() for x in ring.tensors()] == buffers
    _close(ring.memory, state.memory)
    assert torch.equal(ring.written, state.written)


def test_ring_step_runs_under_bfloat16_autocast_with_empty_slots():
    """Decoding under bf16 autocast (as after training on the GPU) gives bf16 scores while the state
    is fp32: the empty slots of a ring (a prompt shorter than the window) are masked with a value
    the scores' dtype holds, and the steps stay close to the fp32 ones."""
    t, window, n = 3, 8, 10
    xs = [x.detach().float() for x in _hybrid_inputs(2, 4, 2, t + n, seed=5)]
    kw = dict(scale=0.5, softcap=2.0)
    _, state = ops.delta_window_chunked(*_cut(xs, slice(None, t)), window=window, **kw, output_final_state=True,
                                        chunk_size=4)
    ring = ops.RingDeltaState.from_state(state.map(torch.clone), window)
    ring_bf16 = ops.RingDeltaState.from_state(state.map(torch.clone), window)
    state_bf16 = state
    assert not ring.valid.all()
    for i in range(t, t + n):
        one = _cut(xs, slice(i, i + 1))
        ref, ring = ops.delta_window_step_ring(*one, ring, **kw)
        half = [x.bfloat16() if j < 5 else x for j, x in enumerate(one)]  # q, k, qd, kd, v; fp32 gates
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, ring_bf16 = ops.delta_window_step_ring(*half, ring_bf16, **kw)
            out_step, state_bf16 = ops.delta_window_step(*half, state_bf16, window=window, **kw)
        assert out.dtype == torch.bfloat16
        for o in (out, out_step):
            torch.testing.assert_close(o.float(), ref, atol=0.05, rtol=0.05)
    torch.testing.assert_close(ring_bf16.memory, ring.memory, atol=0.05, rtol=0.05)


def test_fast_decoder_runs_under_bfloat16_autocast(tiny_model):
    """The fast decoder of a delta student under bf16 autocast, the prompt shorter than the window."""
    from linearize.decode import fast_generate

    student = tiny_student(tiny_model, "llama", {**SPEC, "window": 8}, dtype=torch.float32)
    ids = torch.randint(2, 97, (2, 3), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fast_generate(student, ids, torch.ones_like(ids), max_new_tokens=10, pad_token_id=0)
    assert out.shape == (2, 13) and torch.equal(out[:, :3], ids)

def _fake_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **_):
    """fla's contract ([B, T, H, *], as many key heads as query heads, scale applied to q), by our reference."""
    assert q.shape[2] == k.shape[2] and q.is_contiguous() and k.is_contiguous()
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    return tuple(x if x is None or i else t(x) for i, x in enumerate(ops.gated_delta_rule_naive(
        t(q) * scale, t(k), t(v), t(g), t(beta), initial_state=initial_state)[: 2 if output_final_state else 1]
        + ((None,) if not output_final_state else ())))


def test_fla_wrapper_layout(monkeypatch):
    """The fla path's layout, GQA repeat and state bookkeeping, with the kernel faked."""
    fake = types.ModuleType("fla.ops.gated_delta_rule")
    fake.chunk_gated_delta_rule = _fake_chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    xs = _gdn_inputs(2, 6, 2, 13)
    s0 = torch.rand(2, 2, 5, 4, dtype=torch.float64) * 0.1
    ref, ref_state = ops.gated_delta_rule_chunked(*xs, initial_state=s0, output_final_state=True)
    out, state = ops.gated_delta_rule_fla(*xs, initial_state=s0, output_final_state=True)
    _close(out, ref)
    _close(state, ref_state)



@pytest.mark.parametrize("capability,triton,tilelang,refused", [
    ((9, 0), "3.3.1", False, False), ((9, 0), "3.4.0", False, True), ((9, 0), "3.6.0", False, True),
    ((9, 0), "3.7.1rc1", False, True), ((9, 0), "3.7.1", False, False), ((9, 0), "3.8.0", False, False),
    ((8, 0), "3.6.0", False, False), ((10, 0), "3.6.0", False, False), ((9, 0), "3.6.0", True, False)])
def test_fla_gated_backward_refused(capability, triton, tilelang, refused):
    """fla 0.6 refuses the gated backward on Hopper with Triton in [3.4.0, 3.7.1) and no TileLang."""
    from linearize.ops.fla_backend import fla_gated_backward_refused

    assert fla_gated_backward_refused(capability, triton, tilelang) is refused


def test_auto_backend_trains_off_fla_where_its_backward_is_refused(monkeypatch, caplog):
    """Where fla would refuse the backward, "auto" takes the chunked form for calls that need
    gradients (saying so once), keeps fla for forward-only calls; "fla" keeps fla."""
    from linearize.ops import fla_backend
    from linearize.ops.delta import rule as delta_rule

    calls = []
    fake = types.ModuleType("fla.ops.gated_delta_rule")
    fake.chunk_gated_delta_rule = lambda *a, **kw: calls.append(1) or _fake_chunk_gated_delta_rule(*a, **kw)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    monkeypatch.setattr(fla_backend, "use_fla", lambda q, backend, dtype=None: backend != "torch")
    monkeypatch.setattr(fla_backend, "fla_gated_backward_refused_on", lambda device: True)
    delta_rule._say_fla_backward_refused.cache_clear()
    xs = _gdn_inputs(2, 4, 2, 9)
    ref, _ = ops.gated_delta_rule_chunked(*xs)
    with caplog.at_level("WARNING", logger="linearize.ops.delta.rule"):
        for _ in range(2):
            out, _ = ops.gated_delta_rule(*xs, backend="auto")
            _close(out, ref)
    assert not calls
    assert len([r for r in caplog.records if "PyTorch chunked form" in r.message]) == 1
    with torch.no_grad():
        ops.gated_delta_rule(*xs, backend="auto")
    assert len(calls) == 1
    ops.gated_delta_rule(*xs, backend="fla")
    assert len(calls) == 2

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(2, 9, 3, 300), (1, 4, 4, 2100)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 5e-2)])
def test_fla_gated_delta_rule_equals_the_chunked_form_on_cuda(shape, dtype, tol):
    """fla 0.6's chunk_gated_delta_rule against our chunked form in float64: outputs, final state and
    every gradient (GQA, lengths off the chunk, an initial state), head widths of SmolLM2 (64). Where fla
    refuses the gated backward (Hopper with Triton in [3.4, 3.7.1), ``fla_gated_backward_refused``, and
    ``backend: auto`` trains through the chunked form there), outputs and final state only."""
    pytest.importorskip("fla")
    from linearize.ops.fla_backend import fla_gated_backward_refused_on

    with_grads = not fla_gated_backward_refused_on(torch.device("cuda"))
    b, h, hk, t = shape
    xs = [x.detach().to(dtype) for x in _gdn_inputs(b, h, hk, t, kd=64, vd=64, device="cuda", dtype=torch.float32)]
    s0 = torch.randn(b, hk, 64, 64, device="cuda") * 0.05
    w = torch.randn(b, h, t, 64, device="cuda", dtype=torch.float64)
    got = {}
    for name in ("torch", "fla"):  # the reference sees the very inputs fla sees, in float64
        ins = [(x.double() if name == "torch" else x.clone()).requires_grad_(True) for x in xs]
        fn = ops.gated_delta_rule_chunked if name == "torch" else ops.gated_delta_rule_fla
        o, s = fn(*ins, initial_state=s0.double() if name == "torch" else s0, output_final_state=True)
        grads = torch.autograd.grad((o.double() * w).sum(), ins) if with_grads else ()
        got[name] = [o, s, *grads]
    for ref, out in zip(got["torch"], got["fla"]):
        scale = ref.abs().max().clamp_min(1e-6)
        assert ((out.double() - ref).abs().max() / scale).item() < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_window_sdpa_equals_the_chunked_form_on_cuda(monkeypatch, dtype, tol):
    """The window's SDPA on blocks on CUDA (the path ``WINDOW_SDPA: auto`` takes there) and, in bf16, the
    window through the hybrid's kernels (``WINDOW_KERNEL``) against the chunked form in float64: outputs and
    gradients, GQA, left padding, SmolLM2's head width, a 2k block."""
    from linearize.ops import window as delta_rule

    b, h, hk, t, d = 2, 9, 3, 2048, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    xs = [r(b, h, t, d), r(b, hk, t, d), F.normalize(r(b, h, t, d), dim=-1), F.normalize(r(b, hk, t, d), dim=-1),
          r(b, hk, t, d), -F.softplus(r(b, hk, t)), torch.sigmoid(r(b, hk, t)), torch.sigmoid(r(b, h, t))]
    mask = torch.ones(b, t, dtype=torch.bool, device="cuda")
    mask[1, :300] = False
    w = r(b, h, t, d).double()
    got = {}
    forms = [("sdpa", True, False), ("chunked", False, False)] + ([("kernel", False, True)] if dtype != torch.float32
                                                                   else [])
    for name, sdpa, kernel in forms:
        monkeypatch.setattr(delta_rule, "WINDOW_SDPA", sdpa)
        monkeypatch.setattr(delta_rule, "WINDOW_KERNEL", kernel)
        ins = [(x.to(dtype) if name != "chunked" else x.double()).requires_grad_(True) for x in xs]
        if kernel:
            assert delta_rule._use_window_kernel(*ins[:2], ins[4], 64)
        o, _ = ops.delta_window_chunked(*ins, window=64, scale=d ** -0.5, key_mask=mask, chunk_size=64)
        got[name] = [o, *torch.autograd.grad((o.double() * w).sum(), ins)]
    for name in got.keys() - {"chunked"}:
        for out, ref in zip(got[name], got["chunked"]):
            scale = ref.abs().max().clamp_min(1e-6)
            assert ((out.double() - ref).abs().max() / scale).item() < tol, name


# --- the mixer ------------------------------------------------------------------------------------

SPEC = {"kind": "delta", "window": 4, "chunk_size": 8}


@pytest.mark.parametrize("feature_rope", [True, False])
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_neox", "qwen3"])
def test_delta_student_decodes_like_its_parallel_forward(tiny_model, family, feature_rope):
    student = tiny_student(tiny_model, family, {**SPEC, "feature_rope": feature_rope})
    with torch.no_grad():  # make the gates matter
        for m in linearize.mixers(student).values():
            m.mix_proj.bias.fill_(0.0)
            m.decay_proj.weight.normal_(0, 0.3)
    assert_decodes_like_parallel(student)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_full_window_delta_student_is_the_teacher(tiny_model, family):
    teacher = tiny_model(family, dtype=torch.float64)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    student = linearize.convert(teacher, {"kind": "delta", "window": 32})
    torch.testing.assert_close(student(ids).logits, teacher(ids).logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize("family,feature_rope", [("llama", True), ("gemma2", True), ("qwen3", True),
                                                 ("llama", False)])
def test_fast_decoder_equals_generate(tiny_model, family, feature_rope):
    """``linearize.fast`` (the delta state in fixed ring buffers, batched, left-padded prompts, the
    ring wrapping around many times) gives ``generate()``'s greedy tokens."""
    student = tiny_student(tiny_model, family, {**SPEC, "window": 3, "feature_rope": feature_rope})
    with torch.no_grad():  # make the gates matter
        for m in linearize.mixers(student).values():
            m.mix_proj.bias.fill_(0.0)
            m.decay_proj.weight.normal_(0, 0.3)
    assert_fast_equals_generate(student)


@pytest.mark.parametrize("feature_rope", [True, False])
def test_memory_keys_depend_on_position_only_with_feature_rope(tiny_model, feature_rope):
    """``feature_rope: false``: the memory's keys and queries are read from the q/k before RoPE, so the
    same tokens at other positions write and read the same memory; the window's q/k keep RoPE."""
    student = tiny_student(tiny_model, "llama", {**SPEC, "feature_rope": feature_rope})
    mixer = next(iter(linearize.mixers(student).values()))
    g = mixer.geometry
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, g.n_heads, 6, g.head_dim, generator=gen, dtype=torch.float64), \
        torch.randn(1, g.n_kv_heads, 6, g.head_dim, generator=gen, dtype=torch.float64)
    x = torch.randn(1, 6, student.config.hidden_size, generator=gen, dtype=torch.float64)
    rotary = student.model.rotary_emb
    outs = []
    for start in (0, 40):
        pe = rotary(x, torch.arange(start, start + 6)[None])
        with mixer.reading(x):
            outs.append(mixer._inputs(q, k, pe))
    (qr0, kr0, qd0, kd0, *_), (qr1, kr1, qd1, kd1, *_) = outs
    assert not torch.allclose(kr0, kr1)  # the window's keys are rotated either way
    assert torch.allclose(kd0, kd1) != feature_rope and torch.allclose(qd0, qd1) != feature_rope


def test_delta_left_padded_batch_generates_like_single_sequences(tiny_model):
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


def test_delta_student_saves_loads_and_holds_constant_memory(tiny_model, tmp_path):
    student = linearize.convert(tiny_model("llama"), SPEC)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if any(part in name for part in ("feature_map", "_proj.", "A_log", "dt_bias")) and "self_attn" in name \
                    and not any(t in name for t in ("q_proj", "k_proj", "v_proj", "o_proj")):
                p.add_(torch.randn_like(p) * 0.1)
    linearize.save(student, tiny_tokenizer(), tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu")
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded(ids).logits, student(ids).logits, atol=0, rtol=0)

    def held_after(n):
        cache = LinearizeCache(student)
        plain_generate(student, ids[:1, :6], max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache,
                       pad_token_id=0)
        return cache_nbytes(cache)

    window_flags = 3 * 4  # the window's padding flags (bool), left out of state_bytes as for the hybrid
    assert held_after(12) == held_after(40) == state_bytes(student)["fixed"] + window_flags


def test_attention_transfer_trains_the_new_parameters(tiny_model):
    """Under attention transfer (distill probes) the layer's output MSE to the teacher sends gradients to the
    gates, the mix and the feature maps (the recipes train them later)."""
    from linearize.distill import transfer_probes

    student = linearize.convert(tiny_model("llama"), {"kind": "delta", "window": 4})
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    layers = sorted(linearize.mixers(student))
    with transfer_probes(student, layers) as probes:
        student(ids)
    probes[1].mse.backward()
    m = linearize.mixers(student)[1]
    for name in ("feature_map_q.weight", "feature_map_k.weight", "decay_proj.weight", "beta_proj.weight",
                 "mix_proj.weight", "A_log", "dt_bias"):
        grad = dict(m.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_window_through_the_hybrid_kernels_equals_the_window_softmax():
    """``WINDOW_KERNEL``: the window's softmax through the LoLCATs hybrid's Triton kernels with zero features, on
    the CPU by Triton's interpreter, against the float64 window softmax (values, gradients of q/k/v; GQA,
    padding, soft-capping, a prompt shorter than the window), and the delta hybrid around it against its
    token-by-token reference."""
    run_triton_interpreter_script("triton_interpret_delta_window.py")


def test_fused_ring_step_equals_the_pytorch_ring_step():
    """The delta hybrid's ring step as one Triton launch (what the fast decoder runs on CUDA), on the CPU by
    Triton's interpreter: the PyTorch ring step's outputs and every state buffer, token after token (GQA,
    soft-capping, a window the prompt does not fill, left padding, bf16 buffers); and the fast decoder's
    tokens with it equal those without it."""
    run_triton_interpreter_script("triton_interpret_delta_step.py")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ring_step_on_cuda(dtype):
    """The fused ring step compiled for the GPU against RoPE, the feature maps and the gates in PyTorch and
    the PyTorch ring step: SmolLM2's heads (9 query, 3 key heads of 64), a window of 64, 100 tokens past a
    200-token prefill with left padding, features before RoPE."""
    from linearize.models.base import rope_rotate_half
    from linearize.ops.delta.step_triton import delta_step_fused_triton

    b, h, hk, d, w, t, n = 4, 9, 3, 64, 64, 200, 100
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(b, h, t + n, d).to(dtype), r(b, hk, t + n, d).to(dtype), r(b, hk, t + n, d).to(dtype)
    xa, xb, xl = r(b, t + n, hk), r(b, t + n, hk), r(b, t + n, h)
    angles = r(b, t + n, d // 2) * 3
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    wq, wk, dt, a_log, mix_bias = r(h, d, d) * 0.2, r(hk, d, d) * 0.2, r(hk) * 0.1, r(hk) * 0.5, r(h)
    qr, kr = rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin)
    pre = [qr, kr, F.normalize(q.float() @ wq, dim=-1).to(dtype), F.normalize(k.float() @ wk, dim=-1).to(dtype), v,
           (-a_log.exp() * F.softplus(xa + dt)).transpose(1, 2), torch.sigmoid(xb).transpose(1, 2),
           torch.sigmoid(xl + mix_bias).transpose(1, 2)]
    mask = torch.ones(b, t, dtype=torch.bool, device="cuda")
    mask[1, :150] = False
    with torch.no_grad():
        _, state = ops.delta_window_chunked(*(x[:, :, :t] for x in pre), window=w, scale=d ** -0.5, key_mask=mask,
                                            output_final_state=True)
        twin = ops.RingDeltaState.from_state(state, w)
        ring = ops.FusedRingDeltaState.from_ring(twin.map(torch.clone))
        for i in range(t, t + n):
            sl = slice(i, i + 1)
            want, twin = ops.delta_window_step_ring(*(x[:, :, sl] for x in pre), twin, scale=d ** -0.5)
            got, ring = delta_step_fused_triton(q[:, :, sl], k[:, :, sl], v[:, :, sl], (cos[:, sl], sin[:, sl]), wq,
                                                wk, xa[:, sl], xb[:, sl], xl[:, sl], dt, a_log, mix_bias, ring,
                                                scale=d ** -0.5)
            assert (got.float() - want.float()).abs().max().item() < (1e-4 if dtype == torch.float32 else 3e-2)
        assert (ring.memory - twin.memory).abs().max().item() < (1e-3 if dtype == torch.float32 else 5e-2)
        assert torch.equal(ring.valid, twin.valid[:, None].expand(-1, hk, -1))
        assert torch.equal(ring.written, twin.written[:, None].expand(-1, hk))
        assert torch.equal(ring.ticks, twin.slot.expand(b, hk))
