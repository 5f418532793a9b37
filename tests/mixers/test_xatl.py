"""XATL: the RetNet and Mamba mixers (naive = chunked = recurrent, values and gradients; decoding
through the cache and generate()), the transfer map (what is copied, what is fresh), checkpoints,
and the LIT freezing rule and callback."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import linearize
from helpers import (decode_incrementally, greedy_by_full_forwards, plain_generate, random_grads, tiny_config,
                     tiny_tokenizer)
from linearize import LinearizeError, ops
from linearize.cache import LinearizeCache, RecurrentLayer, cache_nbytes
from linearize.info import state_bytes
from linearize.recipes.lit import LitCallback, LitRule
from linearize.mixers import mamba as mamba_module
from linearize.ops import selective_scan as ss
from linearize.convert.xatl_transfer import build_xatl, transferred_parameters, xatl_softmax_layers

TOL = 1e-10
KINDS = ["retnet", "striped_mamba"]


def _ids(b=2, t=21, seed=0):
    return torch.randint(0, 97, (b, t), generator=torch.Generator().manual_seed(seed))


def _teacher(family="llama", dtype=torch.float64, seed=0, **overrides):
    """A tiny teacher whose weights are large enough (initializer_range 0.2) that every mixer matters."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, **{"initializer_range": 0.2, **overrides})
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def _perturbed(model, seed=1):
    """Move every tensor off its initial value (norms start at exactly one), so equality means copied."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return model


# --------------------------------------------------------------------------- mixers: three equal forms


def _naive_linear_attention(q, k, v, *, log_decay=None, normalize=True, eps=1e-6, initial_state=None,
                            output_final_state=False, chunk_size=64, backend="auto"):
    assert not output_final_state
    return ops.linear_attention_naive(q, k, v, log_decay=log_decay, normalize=normalize, eps=eps,
                                      initial_state=initial_state), None


def _naive_scan(u, dt, A, B, C, D=None, *, chunk_size=64, initial_state=None, output_final_state=False,
                backend="auto", delta_softplus=False):
    assert not output_final_state
    if delta_softplus:
        dt = torch.nn.functional.softplus(dt)
    return ss.selective_scan_naive(u, dt, A, B, C, D, initial_state=initial_state), None


def _naive_conv(x, weight, bias=None, *, initial_state=None, output_final_state=False):
    assert not output_final_state
    return ss.causal_conv1d_naive(x, weight, bias, initial_state=initial_state), None


def _use_naive_ops(monkeypatch):
    monkeypatch.setattr(ops, "linear_attention", _naive_linear_attention)
    monkeypatch.setattr(mamba_module, "selective_scan", _naive_scan)
    monkeypatch.setattr(mamba_module, "causal_conv1d", _naive_conv)


def _close(a, b, tol=TOL):
    assert torch.allclose(a, b, atol=tol, rtol=0), (a - b).abs().max().item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t", [1, 6, 19])
@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_mixer_naive_chunked_recurrent_agree(monkeypatch, kind, t, family):
    student = linearize.convert(_teacher(family), {"kind": kind, "chunk_size": 4})
    mixer = linearize.mixers(student)[1]
    x = torch.randn(2, t, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)
    inputs = [x, *mixer.parameters()]

    chunked, _ = mixer(x)
    cache = DynamicCache()
    recurrent = torch.cat([mixer(x[:, i : i + 1], past_key_values=cache)[0] for i in range(t)], dim=1)
    assert isinstance(cache.layers[1], RecurrentLayer) and cache.layers[1].seen == t
    with monkeypatch.context() as m:
        _use_naive_ops(m)
        naive, _ = mixer(x)
    assert chunked.abs().mean() > 1e-2  # the mixer's output is not negligible
    _close(chunked, naive)
    _close(recurrent, naive)
    for g_naive, g_chunk, g_rec in zip(random_grads(naive, inputs), random_grads(chunked, inputs), random_grads(recurrent, inputs)):
        _close(g_chunk, g_naive)
        _close(g_rec, g_naive)


@pytest.mark.parametrize("kind", KINDS)
def test_mixer_prefill_then_steps_equal_one_pass(kind):
    student = linearize.convert(_teacher(), {"kind": kind, "chunk_size": 4})
    mixer = linearize.mixers(student)[0]
    x = torch.randn(2, 23, 48, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    whole, _ = mixer(x)
    cache = DynamicCache()
    parts = [mixer(x[:, :9], past_key_values=cache)[0], mixer(x[:, 9:14], past_key_values=cache)[0]]
    parts += [mixer(x[:, i : i + 1], past_key_values=cache)[0] for i in range(14, 23)]
    _close(torch.cat(parts, dim=1), whole)
    state = cache.layers[0].state
    assert state.dtype == torch.float64  # float64 in tests; fp32 for fp32/bf16 models
    expected = (2, 96, 3 + 16) if kind == "striped_mamba" else (2, 6, 1, 4, 8)
    assert tuple(state.shape) == expected
    assert mixer.state_bytes(torch.float32) == state.numel() // 2 * 4


def test_retnet_follows_the_paper():
    """Decay 1 - 2^(-5-h) per head, value width twice the key width, the teacher's W_O, swish gate."""
    teacher = _teacher()
    student = linearize.convert(teacher, "retnet")
    m = linearize.mixers(student)[0]
    expect = torch.log1p(-(2.0 ** (-5.0 - torch.arange(6, dtype=torch.float64))))
    torch.testing.assert_close(m.log_decay.double(), expect, atol=1e-7, rtol=0)
    assert m.value_dim == 2 * m.key_dim == 8 and m.n_heads == 6
    assert not hasattr(m, "q_proj") and not hasattr(m, "k_proj") and not hasattr(m, "v_proj")
    assert torch.equal(m.o_proj.weight, teacher.model.layers[0].self_attn.o_proj.weight)
    # one token from an empty state (position 0: no rotation): retention reduces to (q.k) v, then
    # GroupNorm * swish gate, W_O
    x = torch.randn(1, 1, 48, dtype=torch.float64)
    q, k, v = (lin(x).view(1, 6, -1) for lin in (m.wq, m.wk, m.wv))
    o = (q * k).sum(-1, keepdim=True) / 2 * v
    o = torch.nn.functional.group_norm(o.reshape(1, 48), 6, m.group_norm.weight, m.group_norm.bias, eps=1e-6)
    gate = torch.nn.functional.silu(m.wg(x)).reshape(1, 48)
    _close(m(x)[0].reshape(1, 48), m.o_proj(o * gate))


def _retnet_reference(m, x):
    """RetNet's mixer written out from its definition: four projections, the rotation by position x theta
    with rotate_half, keys scaled by d_k^-1/2, retention, GroupNorm over heads * swish gate, W_O."""
    b, t, _ = x.shape
    h, dk, dv = m.n_heads, m.key_dim, m.value_dim
    q, k, v, g = (lin(x).view(b, t, h, -1).transpose(1, 2) for lin in (m.wq, m.wk, m.wv, m.wg))
    pos = torch.arange(t, dtype=torch.float64)
    theta = (1.0 / 10000 ** (torch.arange(0, dk, 2, dtype=torch.float64) / dk)).float().double()  # kept in fp32
    angles = (pos[:, None] * theta).repeat(1, 2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def rot(y):
        y1, y2 = y.chunk(2, dim=-1)
        return y * cos + torch.cat([-y2, y1], dim=-1) * sin

    q, k = rot(q), rot(k) * dk ** -0.5
    o = ops.linear_attention_naive(q, k, v, log_decay=m.log_decay, normalize=False)
    o = torch.nn.functional.group_norm(o.transpose(1, 2).reshape(b * t, h * dv), h, m.group_norm.weight,
                                       m.group_norm.bias, eps=m.group_norm.eps)
    return m.o_proj(o.view(b, t, h * dv) * torch.nn.functional.silu(g.transpose(1, 2).reshape(b, t, h * dv)))


@pytest.mark.parametrize("hooked", [False, True])
def test_retnet_mixer_equals_its_definition(hooked):
    """The mixer (one product for W_Q, W_K, W_V, W_G; queries and keys rotated as one tensor with the
    key scale in the tables) against its definition, values and gradients, continuing a prefill (offset 5).
    hooked: a forward hook on W_Q, so the four projections run one by one (and the hook is seen)."""
    m = linearize.mixers(linearize.convert(_teacher(), {"kind": "retnet", "chunk_size": 4}))[1]
    calls = []
    if hooked:
        m.wq.register_forward_hook(lambda *a: calls.append(1))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 24, 48, generator=g, dtype=torch.float64, requires_grad=True)
    cache = DynamicCache()
    got = torch.cat([m(x[:, :5], past_key_values=cache)[0], m(x[:, 5:], past_key_values=cache)[0]], dim=1)
    want = _retnet_reference(m, x)
    assert not hooked or len(calls) == 3  # prefill, the sequence and the reference
    inputs = [x, *m.parameters()]
    _close(got, want, tol=1e-12)
    for g_got, g_want in zip(random_grads(got, inputs), random_grads(want, inputs)):
        _close(g_got, g_want, tol=1e-12)


def test_retnet_rotation_tables():
    """Rotation tables: the same at an int offset and at a 0-d tensor one (a fast decoder's); queries and
    keys come out in fla's layout."""
    student = linearize.convert(_teacher(dtype=torch.float32), "retnet")
    a = linearize.mixers(student)[0]
    qk = torch.randn(2, 2, 7, 6, 4)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for x, y in zip(a.rotation(7, 3, dtype, qk.device), a.rotation(7, torch.tensor(3), dtype, qk.device)):
            assert x.dtype == dtype and torch.equal(x, y)
    q, k = a.rotate(qk.permute(1, 2, 0, 3, 4), 3)  # [2, B, T, H, D] views of [B, T, 2, H, D]
    assert q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous()


def test_mamba_follows_the_paper():
    student = linearize.convert(_teacher(), "striped_mamba")
    m = linearize.mixers(student)[0]
    assert (m.channels, m.state_size, m.conv_width, m.dt_rank) == (96, 16, 4, 3)  # expand 2, N 16, K 4, ceil(48/16)
    assert m.conv1d.weight.shape == (96, 1, 4) and m.x_proj.out_features == 3 + 2 * 16
    torch.testing.assert_close(-torch.exp(m.A_log[0]), -torch.arange(1, 17, dtype=torch.float64))
    assert torch.equal(m.D, torch.ones(96, dtype=torch.float64))
    dt = torch.nn.functional.softplus(m.dt_proj.bias)
    assert dt.min() >= 1e-4 and dt.max() <= 0.1 + 1e-9
    assert not any(hasattr(m, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))


# --------------------------------------------------------------------------- the model: decoding


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt_neox"])
@pytest.mark.parametrize("kind", KINDS)
def test_decoding_through_the_cache_equals_parallel_forward(family, kind):
    student, _ = build_xatl(_teacher(family), kind, seed=0, chunk_size=8)
    ids = _ids()
    full = student(ids, use_cache=False).logits
    _close(decode_incrementally(student, ids, 13), full)


@pytest.mark.parametrize("kind", KINDS)
def test_model_gradients_recurrent_equal_parallel(kind):
    """Gradients of every parameter through token-by-token decoding equal those of the parallel forward."""
    student, _ = build_xatl(_teacher(num_hidden_layers=2), kind, seed=0, chunk_size=4)
    ids = _ids(t=11)
    params = [p for p in student.parameters()]
    full = student(ids, use_cache=False).logits
    out, steps = None, []
    for t in range(ids.shape[1]):
        out = student(ids[:, t : t + 1], past_key_values=out.past_key_values if out else None, use_cache=True)
        steps.append(out.logits)
    for g_full, g_rec in zip(random_grads(full, params), random_grads(torch.cat(steps, dim=1), params)):
        _close(g_rec, g_full, tol=1e-9)


@pytest.mark.parametrize("arch,hybrid", [("retnet", None), ("mamba", None), ("retnet", "xatl"), ("mamba", "xatl")])
def test_greedy_generate_equals_argmax_of_parallel_forwards(arch, hybrid):
    student, report = build_xatl(_teacher(dtype=torch.float32, num_hidden_layers=4), arch,
                                 keep_softmax=hybrid, seed=0)
    assert report.keep_softmax == ((2,) if hybrid else ())
    student.generation_config.eos_token_id = None  # the tiny config's eos (2) would end generation early
    prompt = _ids(b=1, t=7)
    out = plain_generate(student, prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(student, prompt, 12))


@pytest.mark.parametrize("arch", ["retnet", "mamba"])
def test_cache_memory_does_not_grow_with_generated_length(arch):
    student, _ = build_xatl(_teacher(dtype=torch.float32), arch, seed=0)
    prompt = _ids(b=1, t=8)

    def held_after(n):
        cache = LinearizeCache(student)
        plain_generate(student, prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       past_key_values=cache, pad_token_id=0)
        return cache_nbytes(cache)

    assert held_after(8) == held_after(40) > 0
    assert state_bytes(student)["per_token"] == 0


# --------------------------------------------------------------------------- the transfer map


TRANSFERS = [
    ("retnet", None, None),  # default: embeddings, ffn, wo
    ("retnet", ("embeddings",), None),
    ("retnet", ("embeddings", "ffn"), None),
    ("retnet", ("wo",), None),
    ("retnet", None, "xatl"),  # + attention
    ("retnet", ("embeddings", "ffn", "wo"), "xatl"),  # the kept softmax layers fresh
    ("mamba", None, None),  # default: embeddings, ffn
    ("mamba", ("ffn", "attention"), [0, 3]),
]


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch,transfer,hybrid", TRANSFERS)
def test_transferred_tensors_equal_the_teachers_and_the_rest_is_fresh(arch, transfer, hybrid, tie):
    teacher = _perturbed(_teacher(dtype=torch.float32, num_hidden_layers=4, tie_word_embeddings=tie))
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student, report = build_xatl(teacher, arch, transfer=transfer, keep_softmax=hybrid, seed=0)
    t_state = teacher.state_dict()
    params = dict(student.named_parameters())

    copied, fresh = report.copied_names, report.fresh
    assert set(copied) | set(fresh) == set(params) and not set(copied) & set(fresh)
    assert copied, "something was transferred"
    for name in copied:
        assert torch.equal(params[name], t_state[name]), name
        assert params[name].data_ptr() != t_state[name].data_ptr()  # a copy, not the teacher's storage
    for name in fresh:
        if name in t_state:  # re-initialised teacher-shaped tensors
            assert not torch.equal(params[name], t_state[name]), name
    for name in report.new:
        assert name not in t_state or params[name].shape != t_state[name].shape
    # the groups hold what the docs say
    if "embeddings" in report.transfer:
        assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(report.copied["embeddings"])
    if "ffn" in report.transfer:
        assert "model.layers.1.post_attention_layernorm.weight" in report.copied["ffn"]
    if "wo" in report.transfer:
        assert {"model.layers.1.self_attn.o_proj.weight", "model.layers.1.input_layernorm.weight"} <= set(report.copied["wo"])
    if "attention" in report.transfer:
        assert f"model.layers.{report.keep_softmax[0]}.self_attn.q_proj.weight" in report.copied["attention"]
    if tie:
        assert student.lm_head.weight is student.model.embed_tokens.weight
    # the teacher is untouched; the record is in the config
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())
    assert student.config.linearize["xatl"]["transfer"] == list(report.transfer)
    assert student.config.linearize["keep_softmax"] == list(report.keep_softmax)
    for i in report.keep_softmax:
        assert type(student.model.layers[i].self_attn).__name__ == "LlamaAttention"
    assert set(transferred_parameters(student)) == set(copied)


@pytest.mark.parametrize("arch", ["retnet", "mamba"])
def test_scratch_shares_nothing_with_the_teacher(arch):
    teacher = _perturbed(_teacher(dtype=torch.float32, num_hidden_layers=4, initializer_range=0.02))
    student, report = build_xatl(teacher, arch, transfer="scratch", keep_softmax="xatl", seed=0)
    assert report.copied_names == [] and report.transfer == ()
    teacher_tensors = list(teacher.state_dict().values())
    for name, p in student.named_parameters():
        assert all(p.data_ptr() != t.data_ptr() for t in teacher_tensors), name
        assert not any(p.shape == t.shape and torch.equal(p, t) for t in teacher_tensors), name
    # drawn with the teacher config's initializer_range; norms back at one
    std = student.model.embed_tokens.weight.std().item()
    assert 0.015 < std < 0.025, std
    assert torch.equal(student.model.norm.weight, torch.ones(48))


def test_same_seed_same_student_and_global_rng_untouched():
    teacher = _teacher(dtype=torch.float32)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, _ = build_xatl(teacher, "mamba", transfer=(), seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    b, _ = build_xatl(teacher, "mamba", transfer=(), seed=7)
    c, _ = build_xatl(teacher, "mamba", transfer=(), seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.in_proj.weight"], sc["model.layers.0.self_attn.in_proj.weight"])


@pytest.mark.parametrize("family", ["gemma2", "gpt_neox", "qwen3"])
def test_transfer_map_covers_other_families(family):
    teacher = _perturbed(_teacher(family, dtype=torch.float32, num_hidden_layers=4))
    student, report = build_xatl(teacher, "retnet", keep_softmax="xatl", seed=0)
    t_state, params = teacher.state_dict(), dict(student.named_parameters())
    assert set(report.copied_names) | set(report.fresh) == set(params)
    for name in report.copied_names:
        assert torch.equal(params[name], t_state[name]), name
    if family == "gemma2":  # sandwich norms: the post-attention norm goes with W_O, the FFN's two with the FFN
        assert "model.layers.0.post_attention_layernorm.weight" in report.copied["wo"]
        assert "model.layers.0.post_feedforward_layernorm.weight" in report.copied["ffn"]
    if family == "gpt_neox":
        assert "gpt_neox.layers.0.attention.dense.weight" in report.copied["wo"]
        assert "gpt_neox.final_layer_norm.weight" in report.copied["embeddings"]


def test_xatl_hybrid_layers():
    assert xatl_softmax_layers(30) == (2, 15)
    assert xatl_softmax_layers(24) == (2, 12)
    assert xatl_softmax_layers(4) == (2,)


@pytest.mark.parametrize("kwargs,match", [
    (dict(arch="mamba", transfer=("embeddings", "wo")), "W_O cannot be transferred to striped_mamba"),
    (dict(arch="retnet", transfer=("attention",)), "give keep_softmax layers"),
    (dict(arch="retnet", transfer="embeddings,mlp"), "unknown transfer item"),
    (dict(arch="gla"), "unknown XATL architecture"),
    (dict(arch="retnet", keep_softmax=[9]), "out of range"),
    (dict(arch="retnet", keep_softmax="first"), "layer indices"),
    (dict(arch="retnet", kind="lolcats"), "sets kind itself"),
    (dict(arch="retnet", norm="sum"), "GroupNorm"),
])
def test_bad_choices_fail_with_one_line(kwargs, match):
    teacher = _teacher(dtype=torch.float32)
    with pytest.raises(LinearizeError, match=match) as err:
        build_xatl(teacher, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch,hybrid", [("retnet", "xatl"), ("mamba", None)])
def test_save_load_roundtrip_gives_identical_logits(tmp_path, arch, hybrid):
    student, report = build_xatl(_teacher(dtype=torch.float32, num_hidden_layers=4), arch,
                                 keep_softmax=hybrid, seed=0)
    linearize.save(student, tiny_tokenizer(), tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu")
    ids = _ids()
    torch.testing.assert_close(loaded(ids).logits, student(ids).logits, atol=0, rtol=0)
    assert loaded.config.linearize == student.config.linearize
    assert set(transferred_parameters(loaded)) == set(report.copied_names)
    out = loaded.generate(ids[:1, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 9)


# --------------------------------------------------------------------------- LIT


def _rule_fires(losses, **kw):
    rule = LitRule(**kw)
    fired = [i for i, loss in enumerate(losses) if rule.update(loss)]
    return fired, rule


def test_lit_rule_on_scripted_losses():
    # improvements: 10%, 5%, 0.5% -> fires at the 4th interval (index 3) with threshold 1%, patience 1
    assert _rule_fires([10.0, 9.0, 8.55, 8.50725, 8.0])[0] == [3]
    # patience 2: one slow interval (0.5%) then a fast one resets the count; fires after two slow in a row
    losses = [10.0, 9.95, 9.0, 8.96, 8.95, 8.0]
    assert _rule_fires(losses, patience=2)[0] == [4]
    assert _rule_fires(losses, patience=1)[0] == [1]
    # a rising loss is no improvement; the first interval never counts; it fires only once
    fired, rule = _rule_fires([5.0, 5.5, 4.0, 4.0, 4.0])
    assert fired == [1] and rule.fired_at == 1
    assert _rule_fires([5.0])[0] == []
    assert _rule_fires([5.0, 4.0, 3.0, 2.0])[0] == []  # always improving by more than 1%
    assert _rule_fires([5.0, 4.0, float("nan")])[0] == [2]
    # exactly at the threshold is not below it
    assert _rule_fires([100.0, 99.0, 98.5], threshold=0.01)[0] == [2]  # 1% exactly, then 0.51%
    with pytest.raises(LinearizeError):
        LitRule(patience=0)


def _lit_student():
    student, report = build_xatl(_teacher(dtype=torch.float32), "retnet", seed=0)
    return student, report


class _State:
    def __init__(self):
        self.global_step = 0
        self.log_history = []


@pytest.mark.parametrize("mode", ["lit", "frozen", "unfrozen"])
def test_lit_callback_freezes_and_thaws_when_the_rule_says(mode, caplog):
    student, report = _lit_student()
    copied = set(report.copied_names)
    optimizer = torch.optim.AdamW(student.parameters())
    cb = LitCallback(mode=mode, threshold=0.01, patience=1)
    state = _State()
    cb.on_train_begin(None, state, None, model=student, optimizer=optimizer)

    def frozen_names():
        return {n for n, p in student.named_parameters() if not p.requires_grad}

    assert frozen_names() == (set() if mode == "unfrozen" else copied)
    losses = [6.0, 5.0, 4.6, 4.58, 4.0]  # improvements 16.7%, 8%, 0.43% -> LIT fires at the 4th evaluation
    expected = LitRule()
    with caplog.at_level(logging.WARNING, logger="linearize.recipes.lit"):
        for i, loss in enumerate(losses):
            state.global_step = 10 * (i + 1)
            fires = expected.update(loss)
            cb.on_evaluate(None, state, None, metrics={"eval_loss": loss})
            if mode == "lit":
                assert frozen_names() == (set() if expected.fired else copied)
                assert ("LIT fired at step" in caplog.text) == expected.fired
                if fires:
                    assert cb.unfrozen_at_step == 40
    assert frozen_names() == {"lit": set(), "frozen": copied, "unfrozen": set()}[mode]
    if mode == "lit":
        assert state.log_history == [{"lit_unfrozen": 1.0, "step": 40}]
        assert caplog.text.count("LIT fired") == 1
    cb.on_train_end(None, state, None)
    assert frozen_names() == set()


def test_lit_callback_state_survives_a_resume():
    student, _ = _lit_student()
    cb = LitCallback(threshold=0.05, patience=2)
    cb.on_train_begin(None, _State(), None, model=student)
    for loss in (3.0, 2.99, 2.98):
        cb.on_evaluate(None, _State(), None, metrics={"eval_loss": loss})
    saved = cb.state()
    restored = LitCallback(**saved["args"])  # what Trainer does on resume
    for k, v in saved["attributes"].items():
        setattr(restored, k, v)
    assert restored.rule.fired and restored.rule.history == [3.0, 2.99, 2.98]
    restored.on_train_begin(None, _State(), None, model=student)
    assert all(p.requires_grad for p in student.parameters())


def test_lit_refuses_parameters_the_optimizer_does_not_hold():
    student, report = _lit_student()
    for name, p in student.named_parameters():
        p.requires_grad_(name not in report.copied_names)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad])
    with pytest.raises(LinearizeError, match="not in the optimizer"):
        LitCallback().on_train_begin(None, _State(), None, model=student, optimizer=optimizer)


def test_lit_inside_a_trainer_run(tmp_path):
    """A real Trainer: the transferred weights stay put until LIT fires (threshold 100%: at the second
    evaluation, step 4), then train; the new weights train from the first step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    student, report = build_xatl(_teacher(dtype=torch.float32, num_hidden_layers=2), "retnet", seed=0)
    student.train()
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": x, "labels": x} for x in torch.randint(0, 97, (16, 12), generator=g)]
    params = dict(student.named_parameters())
    w_o = "model.layers.0.self_attn.o_proj.weight"
    w_q = "model.layers.0.self_attn.wq.weight"
    start = {n: params[n].detach().clone() for n in (w_o, w_q)}
    moved = {}

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            moved[state.global_step] = {n: not torch.equal(params[n], start[n]) for n in start}

    lit = LitCallback(threshold=1.0, patience=1)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4,
                             learning_rate=1e-2, weight_decay=0.1, eval_strategy="steps", eval_steps=2,
                             logging_steps=2, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=student, args=args, train_dataset=rows, eval_dataset=rows[:4], callbacks=[lit, Watch()])
    trainer.train()
    assert lit.unfrozen_at_step == 4
    assert [moved[s][w_o] for s in range(1, 7)] == [False, False, False, False, True, True]
    assert all(moved[s][w_q] for s in range(1, 7))
    assert any(row.get("lit_unfrozen") for row in trainer.state.log_history)


# --------------------------------------------------------------------------- the real teacher


@pytest.mark.slow
@pytest.mark.parametrize("arch,hybrid", [("retnet", "xatl"), ("mamba", None)])
def test_real_teacher_xatl_build_and_recurrent_decoding(arch, hybrid):
    teacher, tokenizer = linearize.load_teacher(dtype="float32", device="cpu")
    student, report = build_xatl(teacher, arch, keep_softmax=hybrid, seed=0)
    assert report.keep_softmax == ((2, 15) if hybrid else ())
    t_state, params = teacher.state_dict(), dict(student.named_parameters())
    for name in report.copied_names:
        assert torch.equal(params[name], t_state[name]), name
    assert set(report.copied_names) | set(report.fresh) == set(params)
    ids = tokenizer("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                    "must be in want of a wife.", return_tensors="pt").input_ids
    with torch.no_grad():
        full = student(ids, use_cache=False).logits
        out = student(ids[:, :16], use_cache=True)
        steps = [out.logits]
        for t in range(16, ids.shape[1]):
            out = student(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
        diff = (torch.cat(steps, dim=1) - full).abs().max().item()
        assert diff < 1e-3 * max(1.0, full.abs().max().item()), diff
        gen = plain_generate(student, ids[:, :16], max_new_tokens=6, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        seq = ids[:, :16]
        for _ in range(6):
            seq = torch.cat([seq, student(seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(gen, seq)
