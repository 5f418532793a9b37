"""XATL's ``qkv`` transfer item: RetNet retention's W_Q, W_K, W_V from the teacher's attention (the
mapping in ``mixers/retnet.py``), checked against the teacher's own projections and RoPE."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

import linearize
from helpers import tiny_config, tiny_tokenizer
from linearize import LinearizeError
from linearize.mixers.retnet import retention_from_attention, rotary_pairs
from linearize.convert.xatl_transfer import build_xatl, transferred_parameters


def _teacher(family="llama", seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = tiny_config(family, **{"initializer_range": 0.2, "num_hidden_layers": 4, **overrides})
    return AutoModelForCausalLM.from_config(cfg).to(torch.float64).eval()


def test_rotary_pairs_keep_whole_pairs_evenly_spaced():
    assert rotary_pairs(8, 4).tolist() == [0, 2, 4, 6]  # pairs (0, 4) and (2, 6)
    assert rotary_pairs(64, 32).tolist() == list(range(0, 32, 2)) + list(range(32, 64, 2))
    assert rotary_pairs(64, 64).tolist() == list(range(64))
    idx = rotary_pairs(96, 48)
    assert torch.equal(idx[24:], idx[:24] + 48) and len(set(idx.tolist())) == 48
    with pytest.raises(LinearizeError):
        rotary_pairs(8, 16)


def test_mapping_by_hand():
    """Each retention head: the teacher's rows of its query head, and of the key/value head it shares."""
    g = torch.Generator().manual_seed(0)
    h, hk, d, hidden, dk = 6, 2, 8, 5, 4
    wq, wk, wv = (torch.randn(n, d, hidden, generator=g, dtype=torch.float64) for n in (h, hk, hk))
    q, k, v = retention_from_attention(wq, wk, wv, dk)
    assert q.shape == k.shape == (h * dk, hidden) and v.shape == (h * d, hidden)
    for head in range(h):
        kv = head // (h // hk)
        for j, row in enumerate([0, 2, 4, 6]):
            assert torch.equal(q[head * dk + j], wq[head, row])
            assert torch.equal(k[head * dk + j], wk[kv, row])
        for row in range(d):
            assert torch.equal(v[head * d + row], wv[kv, row])
    with pytest.raises(LinearizeError, match="evenly"):
        retention_from_attention(wq, wk[:1].repeat(4, 1, 1), wv[:1].repeat(4, 1, 1), dk)


def test_retention_projections_are_the_teachers_after_rope():
    """Grouped-query tiny Llama (6 heads, 2 key/value heads, head width 8, RoPE base 10000 = RetNet's):
    the student's values are the teacher's repeated values, and its rotated queries and keys are the
    teacher's rotated queries and keys at the kept features, exactly."""
    teacher = _teacher()
    inv_freq = teacher.model.rotary_emb.inv_freq
    torch.testing.assert_close(inv_freq.double(), 10000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    student, report = build_xatl(teacher, "retnet", transfer="embeddings,ffn,wo,qkv", keep_softmax=[1], seed=0)
    x = torch.randn(2, 7, 48, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pos = torch.arange(7)[None].expand(2, -1)
    cos, sin = teacher.model.rotary_emb(x, pos)
    keep = torch.tensor([0, 2, 4, 6])
    for i in (0, 2, 3):
        attn, mixer = teacher.model.layers[i].self_attn, student.model.layers[i].self_attn
        q = attn.q_proj(x).view(2, 7, 6, 8).transpose(1, 2)
        k = attn.k_proj(x).view(2, 7, 2, 8).transpose(1, 2)
        v = repeat_kv(attn.v_proj(x).view(2, 7, 2, 8).transpose(1, 2), 3)
        q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
        qk, v_student, _ = mixer.project(x)
        torch.testing.assert_close(v_student, v, atol=1e-12, rtol=0)
        torch.testing.assert_close(qk[0].transpose(1, 2), q[..., keep], atol=1e-12, rtol=0)
        q_s, k_s = mixer.rotate(qk, 0)  # both sides keep their frequencies in float32: angles agree to ~1e-7
        torch.testing.assert_close(q_s, q_rot[..., keep], atol=1e-6, rtol=0)
        torch.testing.assert_close(k_s * mixer.key_dim ** 0.5, repeat_kv(k_rot, 3)[..., keep], atol=1e-6, rtol=0)
        assert torch.equal(mixer.o_proj.weight, attn.o_proj.weight)  # wo: the teacher's W_O
    # the report: q/k/v under their own item, the kept softmax layer untouched, the gate fresh
    params = dict(student.named_parameters())
    assert {f"model.layers.{i}.self_attn.{w}.weight" for i in (0, 2, 3) for w in ("wq", "wk", "wv")} \
        == set(report.copied["qkv"])
    assert "model.layers.0.self_attn.wg.weight" in report.new
    assert type(student.model.layers[1].self_attn).__name__ == "LlamaAttention"  # kept softmax: not a qkv target
    assert set(report.copied_names) | set(report.fresh) == set(params)
    # an initialisation of the mixer: never frozen by frozen / LIT
    assert not set(transferred_parameters(student)) & set(report.copied["qkv"])
    assert set(transferred_parameters(student)) == set(report.copied_names) - set(report.copied["qkv"])


def test_qkv_changes_nothing_else_and_without_it_the_build_is_as_before():
    """Same seed with and without qkv: every other tensor equal (the fresh draws are not disturbed);
    without it, q/k/v are fresh and listed as the mixers' own."""
    teacher = _teacher()
    a, ra = build_xatl(teacher, "retnet", seed=3)
    b, rb = build_xatl(teacher, "retnet", transfer="embeddings,ffn,wo,qkv", seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    for name in sa:
        same = torch.equal(sa[name], sb[name])
        assert same != any(name.endswith(f".{w}.weight") for w in ("wq", "wk", "wv")), name
    assert "qkv" not in ra.copied and "model.layers.0.self_attn.wq.weight" in ra.new
    assert "qkv" not in ra.reinitialised and rb.transfer == ("embeddings", "ffn", "wo", "qkv")


def test_gpt_neox_fused_projection():
    """GPT-NeoX keeps q/k/v in one fused projection laid out per head as [q | k | v]."""
    teacher = _teacher("gpt_neox")
    student, _ = build_xatl(teacher, "retnet", transfer="qkv", seed=0)
    w = teacher.gpt_neox.layers[1].attention.query_key_value.weight  # [H * 3 * D, hidden], H=6, D=8
    mixer = student.gpt_neox.layers[1].attention
    for head in range(6):
        base = head * 24
        assert torch.equal(mixer.wv.weight[head * 8:(head + 1) * 8], w[base + 16:base + 24])
        assert torch.equal(mixer.wq.weight[head * 4:(head + 1) * 4], w[base + torch.tensor([0, 2, 4, 6])])
        assert torch.equal(mixer.wk.weight[head * 4:(head + 1) * 4], w[base + 8 + torch.tensor([0, 2, 4, 6])])


def test_qkv_refused_where_the_mixer_has_none():
    with pytest.raises(LinearizeError, match="q/k/v cannot be transferred to striped_mamba") as err:
        build_xatl(_teacher(), "mamba", transfer="embeddings,qkv")
    assert "\n" not in str(err.value)


def test_save_load_keeps_the_record(tmp_path):
    teacher = _teacher().float()
    student, report = build_xatl(teacher, "retnet", transfer="embeddings,ffn,qkv", seed=0)
    linearize.save(student, tiny_tokenizer(), tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu")
    assert loaded.config.linearize["xatl"]["transfer"] == ["embeddings", "ffn", "qkv"]
    assert torch.equal(loaded.model.layers[0].self_attn.wv.weight, student.model.layers[0].self_attn.wv.weight)
    assert set(transferred_parameters(loaded)) == set(report.copied_names) - set(report.copied["qkv"])
