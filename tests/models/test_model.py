"""Then the model: conversion on every family, incremental decoding, generate(), save/load, memory."""

import pytest
import torch

import linearize
from linearize import LinearizeError
from helpers import decode_incrementally, greedy_by_full_forwards, plain_generate, tiny_tokenizer
from linearize.cache import LinearizeCache, RecurrentLayer, cache_nbytes

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "smollm3", "gpt_neox"]
KINDS = [
    {"kind": "linear", "feature_map": "hedgehog", "feature_dim": 8},
    {"kind": "linear", "feature_map": "t2r", "feature_dim": 8},
    {"kind": "linear", "feature_map": "elu"},
    {"kind": "linear", "feature_map": "relu", "decay": "retnet"},
    {"kind": "lolcats", "window": 4, "feature_dim": 8},
    {"kind": "supra"},
    {"kind": "supra", "decay": "lightning"},
    {"kind": "supra", "norm": "sum", "decay": "none"},
]


def _ids(b=2, t=21, seed=0):
    return torch.randint(0, 97, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_full_window_hybrid_is_the_teacher(tiny_model, family):
    teacher = tiny_model(family, dtype=torch.float64)
    ids = _ids()
    student = linearize.convert(teacher, {"kind": "lolcats", "window": 32})
    tol = 1e-6 if family.startswith("gemma") else 1e-10  # gemma's eager softmax runs in float32
    torch.testing.assert_close(student(ids).logits, teacher(ids).logits, atol=tol, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", KINDS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_decoding_through_the_cache_equals_parallel_forward(tiny_model, family, spec):
    student = linearize.convert(tiny_model(family, dtype=torch.float64), {**spec, "chunk_size": 8})
    ids = _ids()
    full = student(ids, use_cache=False).logits
    torch.testing.assert_close(decode_incrementally(student, ids, 13), full, atol=1e-10, rtol=0)


def test_teacher_untouched_and_spec_recorded(tiny_model):
    teacher = tiny_model("llama")
    student = linearize.convert(teacher, "supra", keep_softmax=[1])
    assert type(teacher.model.layers[0].self_attn).__name__ == "LlamaAttention"
    assert type(student.model.layers[0].self_attn).__name__ == "SupraAttention"
    assert type(student.model.layers[1].self_attn).__name__ == "LlamaAttention"
    assert student.config.linearize["spec"]["decay"] == "retnet"
    assert student.config.linearize["keep_softmax"] == [1]
    assert not hasattr(teacher.config, "linearize")
    assert linearize.spec_of(student).kind == "supra"
    # the projections are the teacher's weights (copied), under the teacher's names
    torch.testing.assert_close(student.model.layers[0].self_attn.q_proj.weight, teacher.model.layers[0].self_attn.q_proj.weight)
    assert "model.layers.0.self_attn.q_proj.weight" in student.state_dict()


@pytest.mark.parametrize("spec", [{"kind": "lolcats", "window": 4}, {"kind": "supra"}, {"kind": "linear", "keep_softmax": [0, 2]}])
def test_greedy_generate_equals_argmax_of_parallel_forwards(tiny_model, spec):
    student = linearize.convert(tiny_model("llama"), spec)
    prompt = _ids(b=1, t=7)
    out = plain_generate(student, prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(student, prompt, 12))


def test_generate_with_explicit_linearize_cache(tiny_model):
    student = linearize.convert(tiny_model("llama"), "lolcats", keep_softmax=[1], window=4)
    cache = LinearizeCache(student)
    assert isinstance(cache.layers[0], RecurrentLayer) and not isinstance(cache.layers[1], RecurrentLayer)
    prompt = _ids(b=2, t=5)
    a = plain_generate(student, prompt, max_new_tokens=6, do_sample=False, past_key_values=cache, pad_token_id=0)
    b = student.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)
    assert cache.get_seq_length() == 5 + 6 - 1


@pytest.mark.parametrize("spec", [{"kind": "lolcats", "window": 16}, {"kind": "supra"}, {"kind": "linear"}])
def test_cache_memory_does_not_grow_with_generated_length(tiny_model, spec):
    student = linearize.convert(tiny_model("llama"), spec)
    prompt = _ids(b=1, t=8)

    def held_after(n):
        cache = LinearizeCache(student)
        plain_generate(student, prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       past_key_values=cache, pad_token_id=0)
        return cache_nbytes(cache)

    small, large = held_after(64), held_after(1024)
    assert small == large > 0


def test_softmax_layers_grow_while_linear_layers_do_not(tiny_model):
    student = linearize.convert(tiny_model("llama"), "linear", keep_softmax=[0])
    cache = LinearizeCache(student)
    plain_generate(student, _ids(b=1, t=4), max_new_tokens=8, min_new_tokens=8, do_sample=False, past_key_values=cache,
                   pad_token_id=0)
    assert cache.layers[0].keys.shape[2] == 4 + 8 - 1  # the kept softmax layer grows
    assert all(isinstance(layer, RecurrentLayer) for layer in cache.layers[1:])


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "qwen3"])
@pytest.mark.parametrize("spec", [{"kind": "lolcats", "window": 4}, {"kind": "supra"}, {"kind": "linear", "feature_map": "t2r", "keep_softmax": [1]}])
def test_save_load_roundtrip_gives_identical_logits(tiny_model, tmp_path, family, spec):
    student = linearize.convert(tiny_model(family), spec)
    with torch.no_grad():  # make the new parameters non-trivial so a lost tensor would show
        for name, p in student.named_parameters():
            if "feature_map" in name or "window_logit" in name or "group_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    linearize.save(student, None, tmp_path / "ckpt")
    tiny_tokenizer().save_pretrained(tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu")
    ids = _ids()
    torch.testing.assert_close(loaded(ids).logits, student(ids).logits, atol=0, rtol=0)
    assert loaded.config.linearize == student.config.linearize
    out = loaded.generate(ids[:1, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 9)


def test_load_rejects_bad_folders(tmp_path):
    with pytest.raises(LinearizeError, match="no checkpoint folder"):
        linearize.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LinearizeError, match="no config.json"):
        linearize.load(tmp_path / "empty")


def test_bad_specs_fail_with_one_line(tiny_model):
    model = tiny_model("llama")
    for bad in [{"kind": "mamba"}, {"feature_map": "cosine"}, {"window": 0}, {"colour": "red"}, {"keep_softmax": [7]}]:
        with pytest.raises(LinearizeError) as err:
            linearize.convert(model, bad)
        assert "\n" not in str(err.value)


def test_unsupported_architecture(tiny_model):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(LinearizeError, match="unsupported architecture 'gpt2'.*llama"):
        linearize.convert(gpt2)


@pytest.mark.parametrize("spec", ["lolcats", "linear", "supra", {"kind": "linear", "decay": "lightning"}])
def test_new_parameters_and_buffers_follow_the_teacher_device(tiny_model, spec):
    """Converting a model on another device (meta here, CUDA on the GPU) leaves nothing on the CPU."""
    teacher = tiny_model("llama").to("meta")
    student = linearize.convert(teacher, spec)
    devices = {t.device.type for t in [*student.parameters(), *student.buffers()]}
    assert devices == {"meta"}


@pytest.mark.parametrize("spec", [{"kind": "lolcats", "window": 4, "feature_dim": 8}, {"kind": "supra"},
                                  {"kind": "linear", "decay": "retnet"}, {"kind": "lolcats", "keep_softmax": [1]}])
def test_left_padded_batch_generates_like_single_sequences(tiny_model, spec):
    student = linearize.convert(tiny_model("llama"), spec)
    prompts = [_ids(b=1, t=9, seed=1)[0], _ids(b=1, t=4, seed=2)[0]]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    batch = plain_generate(student, ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = plain_generate(student, p[None], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(batch[i, width:], alone[0, len(p):]), spec


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text", "gpt_neox"])
def test_teacher_mode_reproduces_the_teacher(tiny_model, family):
    """Attention transfer's target: a mixer seen through ``softmax_view`` computes the softmax attention it replaced."""
    teacher = tiny_model(family, dtype=torch.float64)
    from linearize.distill import softmax_view

    student = linearize.convert(teacher, "lolcats", window=4)
    ids = _ids()
    tol = 1e-6 if family.startswith("gemma") else 1e-10
    with softmax_view(student):
        logits = student(ids).logits
    torch.testing.assert_close(logits, teacher(ids).logits, atol=tol, rtol=0)
    assert all(type(m).__name__ == "LolcatsAttention" for m in linearize.mixers(student).values())  # put back
