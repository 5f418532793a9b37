"""SUPRA: its GroupNorm and decay are really applied, and uptraining lowers validation loss."""

import pytest
import torch

import linearize
from linearize.recipes import uptrain
from linearize.recipes.supra import SupraConfig


def _mixer_output(student, ids):
    """Layer 0's mixer output before W_O, captured from the model's forward."""
    mixer = linearize.mixers(student)[0]
    seen = {}
    handle = mixer.o_proj.register_forward_hook(lambda m, args, out: seen.setdefault("o", args[0]))
    student(ids, use_cache=False)
    handle.remove()
    return mixer, seen["o"]


def test_groupnorm_is_applied(tiny_model):
    # large weights so the raw outputs dwarf GroupNorm's eps
    student = linearize.convert(tiny_model("llama", dtype=torch.float64, initializer_range=1.0), "supra")
    mixer, o = _mixer_output(student, torch.randint(0, 97, (2, 17)))
    per_head = o.view(2, 17, mixer.geometry.n_heads, mixer.geometry.head_dim)
    assert per_head.mean(-1).abs().max() < 1e-6  # GroupNorm (weight 1, bias 0 at init): zero mean ...
    var = per_head.var(-1, unbiased=False)  # ... and unit variance per head, except where the ReLU
    assert (((var - 1).abs() < 1e-3) | (var < 1e-12)).all()  # kernel zeroed every score (all-zero output)
    assert ((var - 1).abs() < 1e-3).float().mean() > 0.5


def test_decay_is_applied(tiny_model):
    teacher = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(0, 97, (1, 40))
    decayed = linearize.convert(teacher, "supra")
    mixer = linearize.mixers(decayed)[0]
    expected = torch.log1p(-(2.0 ** (-5.0 - torch.arange(6, dtype=torch.float64)))).float()
    torch.testing.assert_close(mixer.log_decay, expected)
    plain = linearize.convert(teacher, {"kind": "supra", "decay": "none"})
    plain.load_state_dict(decayed.state_dict())
    assert not torch.allclose(decayed(ids).logits, plain(ids).logits)
    lightning = linearize.convert(teacher, {"kind": "supra", "decay": "lightning"})
    assert linearize.mixers(lightning)[0].log_decay.min() < linearize.mixers(lightning)[2].log_decay.min()


@pytest.mark.parametrize("variant", [{}, {"new_weights_first": 4}, {"spec": {"kind": "supra", "norm": "sum", "decay": "none"}}],
                         ids=["supra", "two-step", "t2r"])
def test_uptraining_lowers_validation_loss(workspace, monkeypatch, tmp_path, variant):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    cfg = SupraConfig(teacher=str(workspace / "teacher"), data=str(workspace / "corpus.jsonl"),
                    out=str(tmp_path / "run"), block_len=32, eval_blocks=8, batch_size=4, steps=30,
                    lr=3e-3, min_lr=1e-4, warmup_steps=3, eval_steps=10, dtype="float32",
                    sample_prompt="w5 w6 w7", **variant)
    res = uptrain.run(cfg)
    ppl = res["perplexity"]
    assert ppl["student, after training"] < ppl["student, before training"]
    model, _ = linearize.load(tmp_path / "run" / "final", device="cpu")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :3], use_cache=True)
    step = model(ids[:, 3:4], past_key_values=out.past_key_values, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], full[:, 3], atol=1e-4, rtol=1e-4)


def test_head_group_norm_is_groupnorm_over_the_heads():
    """The layer-norm form used in training equals nn.GroupNorm(H, H*D) on [B*T, H*D], values and gradients."""
    from linearize.mixers.base import head_group_norm

    g = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 3, 5, 4
    o = torch.randn(b, h, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    norm = torch.nn.GroupNorm(h, h * d, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h * d, generator=g))
        norm.bias.copy_(torch.randn(h * d, generator=g))
    w_out = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    ours = head_group_norm(o, norm)
    ref = norm(o.transpose(1, 2).reshape(b * t, h * d)).view(b, t, h, d).transpose(1, 2)
    assert torch.allclose(ours, ref, atol=1e-12, rtol=0)
    params = [o, norm.weight, norm.bias]
    for got, want in zip(torch.autograd.grad((ours * w_out).sum(), params),
                         torch.autograd.grad((ref * w_out).sum(), params)):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])  # grouped keys and full RoPE; partial RoPE
def test_features_equal_the_kernel_and_rope_applied_apart(tiny_model, family):
    """Queries and keys share one product with the kernel and one RoPE: the same as mapping and
    rotating them apart, values and gradients (float64)."""
    student = linearize.convert(tiny_model(family, dtype=torch.float64), "supra")
    mixer = linearize.mixers(student)[0]
    g, fmap = mixer.geometry, mixer.feature_map
    with torch.no_grad():
        fmap.weight.add_(0.3 * torch.randn_like(fmap.weight))
        fmap.bias.add_(0.3 * torch.randn_like(fmap.bias))
    gen = torch.Generator().manual_seed(0)
    b, t = 2, 7
    hidden = torch.randn(b, t, student.config.hidden_size, generator=gen, dtype=torch.float64, requires_grad=True)
    q, k, _ = mixer.adapter.qkv(mixer, hidden)
    position_embeddings = student.base_model.rotary_emb(hidden, torch.arange(t)[None])

    def apart():
        qf = torch.relu(q @ fmap.weight + fmap.bias)
        kf = torch.relu(k @ fmap.weight + fmap.bias)
        qf, kf = g.rotary(qf, kf, *position_embeddings)
        return qf * g.scaling, kf

    params = [hidden, fmap.weight, fmap.bias]
    for ours, ref in zip(mixer.features(q, k, position_embeddings), apart()):
        assert torch.allclose(ours, ref, atol=1e-12, rtol=0)
        w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        for got, want in zip(torch.autograd.grad((ours * w).sum(), params, retain_graph=True),
                             torch.autograd.grad((ref * w).sum(), params, retain_graph=True)):
            assert torch.allclose(got, want, atol=1e-12, rtol=0)


def test_a_decay_horizon_caps_every_heads_decay(tiny_model):
    """``decay_horizon`` N: no head's fixed decay keeps keys longer than N tokens (1 / -log g <= N); the heads
    already shorter keep theirs; the model changes and decodes as its parallel form."""
    import linearize
    from helpers import decode_incrementally
    from linearize.convert import mixers

    teacher = tiny_model("llama", dtype=torch.float64)
    plain = linearize.convert(teacher, {"kind": "supra"})
    capped = linearize.convert(teacher, {"kind": "supra", "decay_horizon": 40})
    before = next(iter(mixers(plain).values())).log_decay
    after = next(iter(mixers(capped).values())).log_decay
    assert torch.all(after <= -1 / 40 + 1e-7) and torch.equal(after[0], before[0])  # 1 - 2^-5: a 32-token horizon
    assert (after - before).abs().max() > 0
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    full = capped(ids, use_cache=False).logits
    torch.testing.assert_close(decode_incrementally(capped, ids, 13), full, atol=1e-10, rtol=0)
