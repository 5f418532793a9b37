"""Kept softmax layers with a sliding window (``spec.softmax_window``, ``mixers/window.py``, ``ops/window``): the
op's forms equal the definition in float64 (values, gradients, padding), the state and both steps continue a
prefill exactly, and a student whose kept layers have windows converts, decodes (plain loop and fast decoder),
saves, loads and holds constant memory; a window covering the sequence is the teacher."""

import pytest
import torch

import linearize
from helpers import (assert_decodes_like_parallel, assert_fast_equals_generate, cache_bytes_after, random_grads,
                     tiny_student)
from linearize import ops
from linearize.errors import LinearizeError
from linearize.info import state_bytes
from linearize.mixers.window import WindowSoftmax
from linearize.ops import window as W

TOL = 1e-10


def _inputs(b, h, hk, t, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(b, n, t, d, generator=g, dtype=torch.float64) for n in (h, hk, hk)]
    return [x.requires_grad_(True) for x in xs]


def _definition(q, k, v, window, scale, key_mask=None):
    """Each query's softmax over its last ``window`` real keys, itself included (padding queries: 0)."""
    t, grp = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
    pos = torch.arange(t)
    allowed = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
    allowed = allowed[None, None].expand(q.shape[0], 1, t, t)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
        allowed = allowed | torch.eye(t, dtype=torch.bool)[None, None]  # a padding query sees itself alone
    scores = (q @ k.transpose(-1, -2)) * scale
    o = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
    return o if key_mask is None else o * key_mask[:, None, :, None]


@pytest.mark.parametrize("sdpa", [False, True])
@pytest.mark.parametrize("shape,window", [((2, 4, 2, 37), 5), ((1, 6, 3, 16), 16), ((2, 2, 2, 9), 1),
                                          ((1, 3, 1, 30), 40)])
def test_window_softmax_is_the_definition(monkeypatch, sdpa, shape, window):
    """The chunked form (CPU's) and SDPA on blocks (CUDA's, forced here): values and gradients, padding."""
    monkeypatch.setattr(W, "WINDOW_SDPA", sdpa)
    xs = _inputs(*shape)
    mask = torch.ones(shape[0], shape[3], dtype=torch.bool)
    mask[0, :3] = False
    for key_mask in (None, mask):
        want = _definition(*xs, window, 0.4, key_mask)
        got = W.window_softmax(*xs, window=window, scale=0.4, key_mask=key_mask)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        for a, b in zip(random_grads(got, xs), random_grads(want, xs)):
            torch.testing.assert_close(a, b, atol=TOL, rtol=0)


@pytest.mark.parametrize("shape,window", [((2, 6, 2, 37), 5), ((1, 4, 4, 64), 9), ((2, 3, 1, 17), 17),
                                          ((1, 2, 2, 16), 17), ((2, 4, 2, 100), 2), ((1, 2, 1, 24), 12)])
def test_flash_blocks_are_the_definition(shape, window):
    """The causal flash calls on blocks of ``window - 1`` (own block, the previous one read backwards) merged by
    their log-sum-exp: every block count, a last block cut short, a sequence inside the window, grouped heads."""
    from linearize.ops.window import flash

    xs = [x.detach() for x in _inputs(*shape)]
    torch.testing.assert_close(flash.window_softmax_flash(*xs, window=window, scale=0.4), _definition(*xs, window, 0.4),
                               atol=TOL, rtol=0)


def test_window_softmax_takes_the_flash_blocks_only_without_a_gradient(monkeypatch):
    """Prefill and evaluation (no gradient, no padding, no soft-cap, a window of MIN_WINDOW or more) take the
    flash blocks; training, padding, soft-capping and short windows do not."""
    from linearize.ops.window import flash

    calls = []
    real = flash.window_softmax_flash
    monkeypatch.setattr(flash, "window_softmax_flash", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(flash, "MIN_WINDOW", 4)
    xs = _inputs(1, 4, 2, 30)
    with torch.no_grad():
        got = W.window_softmax(*xs, window=6, scale=0.4)
    torch.testing.assert_close(got, _definition(*xs, 6, 0.4), atol=TOL, rtol=0)
    assert len(calls) == 1
    W.window_softmax(*xs, window=6, scale=0.4)  # a gradient wanted
    with torch.no_grad():
        W.window_softmax(*xs, window=6, scale=0.4, key_mask=torch.ones(1, 30, dtype=torch.bool))
        W.window_softmax(*xs, window=6, scale=0.4, softcap=30.0)
        W.window_softmax(*xs, window=3, scale=0.4)  # shorter than MIN_WINDOW
        W.window_softmax(*xs, window=30, scale=0.4)  # covers the sequence: plain causal attention
    assert len(calls) == 1
    monkeypatch.setattr(W, "WINDOW_FLASH", False)
    with torch.no_grad():
        W.window_softmax(*xs, window=6, scale=0.4)
    assert len(calls) == 1


def test_flash_blocks_refused_fall_back_once_with_one_line(monkeypatch, caplog):
    """Flash kernels that refuse (an older GPU): the masked SDPA blocks answer, one warning, no second try."""
    from linearize.ops.window import flash

    monkeypatch.setattr(flash, "MIN_WINDOW", 4)
    monkeypatch.setattr(flash, "AVAILABLE", True)
    tries = []

    def refuse(*a, **kw):
        tries.append(1)
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore")

    monkeypatch.setattr(flash, "_causal_with_lse", refuse)
    xs = [x.detach() for x in _inputs(1, 4, 2, 30)]
    with caplog.at_level("WARNING", logger="linearize.ops.window.flash"):
        for _ in range(2):
            torch.testing.assert_close(W.window_softmax(*xs, window=6, scale=0.4), _definition(*xs, 6, 0.4),
                                       atol=TOL, rtol=0)
    assert len(tries) == 1 and not flash.AVAILABLE
    assert [r.getMessage() for r in caplog.records] == [
        "window-softmax layers prefill through SDPA on masked blocks, not flash blocks: FlashAttention only supports "
        "Ampere GPUs or newer."]


@pytest.mark.parametrize("t,window", [(3, 5), (12, 5), (30, 7)])
def test_state_and_steps_continue_the_prefill(t, window):
    """After a prompt of ``t`` tokens, one token at a time from ``window_state`` (the step and the fast
    decoder's ring, in place) gives the whole sequence's outputs."""
    q, k, v = (x.detach() for x in _inputs(2, 4, 2, t + 9))
    want = _definition(q, k, v, window, 0.4)
    state = W.window_state(k[:, :, :t], v[:, :, :t], window)
    ring = ops.RingHybridState.from_state(W.window_state(k[:, :, :t], v[:, :, :t], window), window,
                                          keep_key_features=False)
    for i in range(t, t + 9):
        one = [x[:, :, i : i + 1] for x in (q, k, v)]
        o, state = W.window_softmax_step(*one, state, window=window, scale=0.4)
        o_ring, ring = W.window_softmax_step_ring(*one, ring, scale=0.4)
        torch.testing.assert_close(o, want[:, :, i : i + 1], atol=TOL, rtol=0)
        torch.testing.assert_close(o_ring, want[:, :, i : i + 1], atol=TOL, rtol=0)
    assert state.keys.shape[2] == min(window, t + 9) and ring.keys.shape[2] == window
    # soft-capped scores (Gemma 2) take the ring's other path: the same as the step
    state = W.window_state(k[:, :, :t], v[:, :, :t], window)
    ring = ops.RingHybridState.from_state(W.window_state(k[:, :, :t], v[:, :, :t], window), window,
                                          keep_key_features=False)
    for i in range(t, t + 9):
        one = [x[:, :, i : i + 1] for x in (q, k, v)]
        o, state = W.window_softmax_step(*one, state, window=window, scale=0.4, softcap=1.5)
        o_ring, ring = W.window_softmax_step_ring(*one, ring, scale=0.4, softcap=1.5)
        torch.testing.assert_close(o_ring, o, atol=TOL, rtol=0)


SPEC = {"kind": "lolcats", "window": 4, "keep_softmax": [1], "softmax_window": 6}


def test_kept_layers_take_the_window_and_a_covering_window_is_the_teacher(tiny_model):
    teacher = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    student = linearize.convert(teacher, {**SPEC, "keep_softmax": [0, 1, 2], "softmax_window": 21})
    assert all(isinstance(m, WindowSoftmax) for m in linearize.mixers(student).values())
    torch.testing.assert_close(student(ids).logits, teacher(ids).logits, atol=TOL, rtol=0)
    narrow = linearize.convert(teacher, {**SPEC, "keep_softmax": [0, 1, 2], "softmax_window": 5})
    assert not torch.allclose(narrow(ids).logits, teacher(ids).logits)
    mixed = linearize.convert(teacher, SPEC)
    kinds = {i: m.kind for i, m in linearize.mixers(mixed).items()}
    assert kinds == {0: "lolcats", 1: "window", 2: "lolcats"}
    assert not any(n for n, _ in linearize.mixers(mixed)[1].new_parameters())  # nothing to train in it
    whole = linearize.convert(teacher, {**SPEC, "softmax_window": 0})  # 0: the layer kept whole, as before
    assert 1 not in linearize.mixers(whole)


def test_a_layer_with_its_own_sliding_window_stays_as_it_is(tiny_model):
    """Gemma 3's local layers (kept by keep_sliding) keep their own window; the global one takes W."""
    teacher = tiny_model("gemma3_text", dtype=torch.float64)
    student = linearize.convert(teacher, {"kind": "lolcats", "window": 4, "keep_sliding": True,
                                          "keep_softmax": [2], "softmax_window": 8})
    assert {i: m.kind for i, m in linearize.mixers(student).items()} == {2: "window"}


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_student_decodes_like_its_parallel_forward(tiny_model, family):
    student = tiny_student(tiny_model, family, SPEC)
    assert_decodes_like_parallel(student)
    assert_decodes_like_parallel(student, prefill=3)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_fast_decoder_equals_generate(tiny_model, family):
    """``linearize.fast`` (the kept layer's window as a ring wrapping many times, batched, left padding)."""
    assert_fast_equals_generate(tiny_student(tiny_model, family, SPEC))


def test_saves_loads_and_holds_constant_memory(tiny_model, tmp_path):
    from helpers import tiny_tokenizer

    student = linearize.convert(tiny_model("llama"), SPEC)
    linearize.save(student, tiny_tokenizer(), tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu")
    assert isinstance(linearize.mixers(loaded)[1], WindowSoftmax)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded(ids).logits, student(ids).logits, atol=0, rtol=0)
    student.generation_config.eos_token_id = None
    assert cache_bytes_after(student, 12) == cache_bytes_after(student, 40)  # past the 6-token window either way
    g = linearize.mixers(student)[1].geometry
    assert linearize.mixers(student)[1].state_bytes(torch.float32) == 6 * (g.n_kv_heads * 2 * g.head_dim * 4 + 1)
    assert state_bytes(student)["fixed"] > 0


@pytest.mark.parametrize("bad", [-1, 2.5, True, "8x", "", "8,1:x", "8,1:0", "8,1:-4", {"w": 3}])
def test_a_bad_softmax_window_is_one_clear_line(bad):
    with pytest.raises(LinearizeError, match="softmax_window"):
        linearize.Spec(softmax_window=bad)


TIERS = {"kind": "lolcats", "window": 4, "keep_softmax": [0, 1], "softmax_window": "6,1:9"}


def test_layers_take_windows_of_their_own(tiny_model, tmp_path):
    """``W,I:W2``: layer I over W2 tokens, the other kept layers over W; either spelling, the saved spec and
    the state's size agree; a window of its own on a layer that keeps no softmax is one clear line."""
    from helpers import tiny_tokenizer

    teacher = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    student = linearize.convert(teacher, TIERS)
    assert {i: m.window for i, m in linearize.mixers(student).items() if m.kind == "window"} == {0: 6, 1: 9}
    other = linearize.convert(teacher, {**TIERS, "softmax_window": "9,0:6"})
    torch.testing.assert_close(other(ids).logits, student(ids).logits, atol=0, rtol=0)
    same = linearize.convert(teacher, {**TIERS, "softmax_window": 6})
    assert not torch.allclose(same(ids).logits, student(ids).logits)  # layer 1's own window is used
    covering = linearize.convert(teacher, {**TIERS, "keep_softmax": [0, 1, 2], "softmax_window": "5,0:21,1:21,2:21"})
    torch.testing.assert_close(covering(ids).logits, teacher(ids).logits, atol=TOL, rtol=0)
    linearize.save(student, tiny_tokenizer(), tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu")
    assert {i: m.window for i, m in linearize.mixers(loaded).items() if m.kind == "window"} == {0: 6, 1: 9}
    g = linearize.mixers(student)[1].geometry
    assert linearize.mixers(student)[1].state_bytes(torch.float32) == 9 * (g.n_kv_heads * 2 * g.head_dim * 4 + 1)
    with pytest.raises(LinearizeError, match=r"layers \[2\] windows of their own, but they keep no softmax"):
        linearize.convert(teacher, {**TIERS, "softmax_window": "6,2:9"})


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # (Gemma 2's layer 0 is local: kept as the teacher's own)
def test_windows_of_their_own_decode_like_the_parallel_forward_and_generate(tiny_model, family):
    student = tiny_student(tiny_model, family, TIERS)
    assert_decodes_like_parallel(student)
    assert_fast_equals_generate(student)


def test_attention_transfer_compares_the_window_layer_and_trains_the_others(tiny_model):
    """Under attention transfer's probes the window layer's output is compared with the teacher's whole
    softmax (a window shorter than the sequence differs) and has nothing of its own to train; the hybrid
    layers' maps get gradients."""
    from linearize.distill import transfer_probes

    student = linearize.convert(tiny_model("llama"), SPEC)
    for p in student.parameters():
        p.requires_grad_(False)
    new = [p for m in linearize.mixers(student).values() for _, p in m.new_parameters()]
    for p in new:
        p.requires_grad_(True)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    with transfer_probes(student, sorted(linearize.mixers(student))) as probes:
        student(ids)
    assert probes[1].mse.item() > 0
    sum(p.mse for p in probes.values()).backward()
    assert all(p.grad is not None for p in new) and new
    assert not any(p.requires_grad for p in linearize.mixers(student)[1].parameters())


F8 = {**TIERS, "softmax_window_dtype": "float8"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_float8_keeps_each_vector_to_e4m3s_precision(dtype):
    from linearize.ops.window.float8 import FLOAT8, dequantize, fake_quantize, quantize

    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(0)).to(dtype) * 5
    x[0, 0, 0] = 0  # a zero vector stays zero
    codes, scale = quantize(x)
    assert codes.dtype == FLOAT8 and scale.shape == (2, 3, 7, 1) and scale.dtype == torch.float32
    back = dequantize(codes, scale, dtype)
    assert back.dtype == dtype and torch.equal(back[0, 0, 0], x[0, 0, 0])
    top = x.abs().amax(-1, keepdim=True).double()
    err = (back.double() - x.double()).abs()
    # e4m3: 3 mantissa bits (half a step: 2^-4 relative), subnormal steps of 2^-9 scales; the largest kept to rounding
    assert (err <= 2 ** -4 * x.double().abs() + 2 ** -10 * scale.double() + 1e-2 * top * 2 ** -7).all()
    torch.testing.assert_close(back.abs().amax(-1, keepdim=True).double(), top, atol=0, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    leaf = x.clone().requires_grad_(True)
    read, _, _ = fake_quantize(leaf)
    torch.testing.assert_close(read, back, atol=0, rtol=0)
    read.sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(x))  # straight through


def test_float8_windows_decode_as_their_parallel_forward_with_half_the_state(tiny_model, tmp_path):
    """A float8 window layer attends over the values its ring gives back, in the parallel forward too: prefill,
    steps, the fast decoder and generate() agree with it exactly; near the exact layer, not equal; about half
    the bytes; saved and loaded; trainable through the rounding (straight through)."""
    from helpers import tiny_tokenizer
    from linearize.ops.window.float8 import Float8RingState, Float8WindowState

    student = tiny_student(tiny_model, "llama", F8)
    exact = tiny_student(tiny_model, "llama", TIERS)
    exact.load_state_dict(student.state_dict())
    assert_decodes_like_parallel(student)
    assert_fast_equals_generate(student)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    a, b = student(ids).logits, exact(ids).logits
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.05 * b.abs().max()
    out = student(ids[:, :15], use_cache=True)
    assert isinstance(out.past_key_values.layers[1].state, Float8WindowState)
    layer = linearize.mixers(student)[1]
    ring = layer.ring_state(out.past_key_values.layers[1].state)
    assert isinstance(ring, Float8RingState) and ring.keys.shape[2] == 9
    g = layer.geometry
    assert layer.state_bytes(torch.bfloat16) == 9 * (g.n_kv_heads * 2 * (g.head_dim + 4) + 1)
    assert layer.state_bytes(torch.bfloat16) < linearize.mixers(exact)[1].state_bytes(torch.bfloat16)  # head dim 8
    linearize.save(student, tiny_tokenizer(), tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu", dtype=torch.float64)
    assert linearize.mixers(loaded)[1].float8
    from linearize.info import describe

    assert "mixers:       window 6 float8 [0], window 9 float8 [1], lolcats [2]" in describe(loaded)
    torch.testing.assert_close(loaded(ids).logits, a, atol=TOL, rtol=0)
    student.zero_grad()
    student(ids).logits.sum().backward()
    assert student.model.layers[1].self_attn.k_proj.weight.grad.abs().sum() > 0


def test_a_bad_softmax_window_dtype_is_one_clear_line():
    with pytest.raises(LinearizeError, match="softmax_window_dtype must be one of auto, float8"):
        linearize.Spec(softmax_window_dtype="int4", softmax_window=8)
    with pytest.raises(LinearizeError, match="give them a window"):
        linearize.Spec(softmax_window_dtype="float8")


SINKS = {**SPEC, "softmax_window_sinks": 3}


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_sinks_decode_like_the_parallel_forward(tiny_model, family):
    """Window layers with attention sinks (``ops/window/sinks.py``): a prefill and steps give the parallel forward
    (prompts longer and shorter than the sinks; gemma2's soft-capped scores), plain generate() full forwards."""
    student = tiny_student(tiny_model, family, SINKS)
    assert_decodes_like_parallel(student)
    assert_decodes_like_parallel(student, prefill=2)


@pytest.mark.parametrize("family,sinks,dtype", [("llama", 3, "auto"), ("gemma2", 3, "auto"), ("llama", 7, "auto"),
                                                ("llama", 3, "float8")])
def test_sinks_fast_decoder_equals_generate(tiny_model, family, sinks, dtype):
    """The fast decoder's ring of sinks + window slots gives generate()'s tokens; with 7 sinks the left-padded
    prompt (5 real tokens) lacks two, which its first decoded tokens become."""
    spec = {**SINKS, "softmax_window_sinks": sinks, "softmax_window_dtype": dtype}
    assert_fast_equals_generate(tiny_student(tiny_model, family, spec))


def test_sinks_change_only_queries_past_the_window_and_cost_their_slots(tiny_model, tmp_path):
    from helpers import tiny_tokenizer
    from linearize.info import describe

    plain = tiny_student(tiny_model, "llama", SPEC)
    sunk = tiny_student(tiny_model, "llama", SINKS)
    sunk.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(2))
    a, b = sunk(ids).logits, plain(ids).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=TOL, rtol=0)  # the 6-token window still holds token 0
    assert (a[:, 6:] - b[:, 6:]).abs().amax(-1).min() > 0
    layer = linearize.mixers(sunk)[1]
    g = layer.geometry
    assert layer.state_bytes(torch.bfloat16) == 9 * (g.n_kv_heads * 2 * g.head_dim * 2 + 1)
    assert "window 6+3 [1]" in describe(sunk)
    sunk.generation_config.eos_token_id = None
    assert cache_bytes_after(sunk, 12) == cache_bytes_after(sunk, 40)
    linearize.save(sunk, tiny_tokenizer(), tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu", dtype=torch.float64)
    assert linearize.mixers(loaded)[1].sinks == 3 and linearize.mixers(loaded)[1].reach == 255  # the context less one
    torch.testing.assert_close(loaded(ids).logits, a, atol=TOL, rtol=0)
    sunk.zero_grad()
    sunk(ids).logits.sum().backward()
    assert sunk.model.layers[1].self_attn.k_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("spec,message", [({"softmax_window_sinks": -1, "softmax_window": 8}, "non-negative whole"),
                                          ({"softmax_window_sinks": 4}, "give them a window")])
def test_bad_sinks_are_one_clear_line(spec, message):
    with pytest.raises(LinearizeError, match=message):
        linearize.Spec(**spec)


def _reach(model, reach):
    """Every sink-keeping window layer of ``model`` with ``reach`` (its least: window + sinks)."""
    from linearize.models import get_adapter

    adapter = get_adapter(model.config)
    layers = [m for m in linearize.mixers(model).values() if m.kind == "window" and m.sinks]
    for m in layers:
        m.set_reach(reach, adapter.rope_tables(model, m.layer_idx))
    return layers


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "gemma3_text"])
def test_sinks_reach_is_the_teachers_context_and_decodes_like_the_parallel_forward(tiny_model, family):
    """Past the teacher's context (``max_position_embeddings - 1``, here set to its least, the window + the sinks)
    a query scores the sinks from there: the prefill (longer and shorter than the reach) and its steps give the
    parallel forward; the fast decoder generate()'s tokens."""
    spec = {**SINKS, "keep_softmax": [2]} if family == "gemma3_text" else SINKS  # gemma3's layer 2 is its global one
    student = tiny_student(tiny_model, family, spec)
    layers = [m for m in linearize.mixers(student).values() if m.kind == "window"]
    assert layers and all(m.reach == student.config.max_position_embeddings - 1 for m in layers)
    ids = torch.randint(0, 97, (2, 25), generator=torch.Generator().manual_seed(3))
    before = student(ids).logits
    assert all(m.reach == 9 for m in _reach(student, 0))
    after = student(ids).logits
    torch.testing.assert_close(after[:, :10], before[:, :10], atol=TOL, rtol=0)  # to position 9: as it was
    assert (after[:, 10:] - before[:, 10:]).abs().amax() > 1e-6
    assert_decodes_like_parallel(student)
    assert_decodes_like_parallel(student, prefill=2)
    assert_fast_equals_generate(student)


def test_sinks_reach_float8_ring_equals_generate(tiny_model):
    student = tiny_student(tiny_model, "llama", {**SINKS, "softmax_window_dtype": "float8"})
    _reach(student, 0)
    assert_fast_equals_generate(student)


def test_a_query_past_the_reach_scores_the_sinks_from_it(tiny_model):
    """The layer's output at a query past the reach is that of the same query moved to the reach with its window
    (RoPE is relative: the window's scores do not change), the sinks where they were."""
    student = tiny_student(tiny_model, "llama", SINKS)
    layer = linearize.mixers(student)[1]
    window, sinks, reach = 6, 3, 12
    [layer] = _reach(student, reach)
    rotary = student.base_model.rotary_emb
    t = 30
    h = torch.randn(1, t, student.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ids = torch.arange(t)[None]
    with torch.no_grad():
        whole = layer(h, position_embeddings=rotary(h, ids), position_ids=ids)[0]
        layer.set_reach(None, None)
        for p in (9, 12, 20, 29):  # before, at and past the reach
            keep = list(range(sinks)) + list(range(p - window + 1, p + 1))
            at = min(p, reach)
            moved = torch.tensor([list(range(sinks)) + list(range(at - window + 1, at + 1))])
            part = h[:, keep]
            alone = layer(part, position_embeddings=rotary(part, moved), position_ids=moved)[0]
            torch.testing.assert_close(alone[:, -1], whole[:, p], atol=TOL, rtol=0)


def test_a_decoder_short_of_the_reach_computes_no_sink_queries(tiny_model):
    """The fast decoder tells the window layers how far its positions go: within the reach their steps compute no
    queries of the sinks' own (nor launches for them); past it they do, and the promise ends with the call."""
    from linearize.decode import fast_generate

    student = tiny_student(tiny_model, "llama", SINKS)
    [layer] = _reach(student, 0)  # reach 9
    made = []
    real = layer._sink_queries
    layer._sink_queries = lambda *a: made.append(real(*a)) or made[-1]
    ids = torch.randint(2, 97, (1, 5), generator=torch.Generator().manual_seed(5))
    fast_generate(student, ids, max_new_tokens=5, pad_token_id=0)  # positions 0..9
    assert made and all(x is None for x in made)
    made.clear()
    fast_generate(student, ids, max_new_tokens=8, pad_token_id=0)  # positions to 12
    assert any(x is not None for x in made) and layer.positions_below is None


def test_rope_tables_are_the_models_own_and_none_where_a_layer_type_is_unknown(tiny_model):
    from types import SimpleNamespace

    from linearize.models import get_adapter

    for family, layer in (("llama", 1), ("gemma3_text", 2)):
        model = tiny_model(family)
        ids = torch.tensor([[7, 300]])
        cos, sin = get_adapter(model.config).rope_tables(model, layer)(ids)
        x = torch.zeros(1)
        kind = (model.config.layer_types[layer],) if family == "gemma3_text" else ()
        want = model.base_model.rotary_emb(x, ids, *kind)
        torch.testing.assert_close((cos, sin), want)

    class TypedRotary(torch.nn.Module):
        def forward(self, x, position_ids, layer_type):
            raise AssertionError("not to be called")

    model = tiny_model("llama")
    fake = SimpleNamespace(base_model=SimpleNamespace(rotary_emb=TypedRotary()), config=SimpleNamespace())
    assert get_adapter(model.config).rope_tables(fake, 0) is None


def test_a_student_with_a_reach_pickles(tiny_model):
    import io
    import pickle

    student = tiny_student(tiny_model, "llama", SINKS)
    pickle.loads(pickle.dumps(student))  # the RoPE tables the reach keeps are no closure
    torch.save(student, io.BytesIO())
