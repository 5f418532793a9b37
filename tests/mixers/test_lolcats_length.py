"""The LoLCATs hybrid's length options (``decay: span | learned | gated``, ``feature_rope: false``) in a
model: every decoding path equals the parallel forward, save/load keeps them, padding stays invisible,
and a fading state stays bounded to 32k tokens where the plain hybrid's grows."""

import pytest
import torch

import linearize
from helpers import decode_incrementally, gated_student, plain_generate, run_triton_interpreter_script
from linearize.cache import LinearizeCache
from linearize.convert import mixers
from linearize.fast import fast_generate

VARIANTS = [
    {"decay": "span"},
    {"decay": "learned"},
    {"decay": "gated"},
    {"feature_rope": False},
    {"feature_rope": False, "decay": "gated"},
    {"norm": "separate"},
    {"norm": "separate", "decay": "gated"},
]
ID = lambda v: "-".join(f"{k}={x}" for k, x in v.items())  # noqa: E731


def _ids(b=2, t=29, seed=0):
    return torch.randint(2, 97, (b, t), generator=torch.Generator().manual_seed(seed))


def _student(tiny_model, variant, family="llama", dtype=torch.float64, window=4, horizon=8):
    spec = {"kind": "lolcats", "window": window, "feature_dim": 8, "decay_horizon": horizon, **variant}
    return gated_student(tiny_model, spec, family, dtype)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt_neox"])
@pytest.mark.parametrize("variant", VARIANTS, ids=ID)
def test_decoding_through_the_cache_equals_parallel_forward(tiny_model, family, variant):
    student = _student(tiny_model, variant, family)
    ids = _ids()
    full = student(ids, use_cache=False).logits
    torch.testing.assert_close(decode_incrementally(student, ids, 13), full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS, ids=ID)
def test_fast_decoder_equals_generate_and_padding_is_invisible(tiny_model, variant):
    student = _student(tiny_model, variant, dtype=torch.float32)
    prompts = [_ids(1, 9, seed=1)[0], _ids(1, 4, seed=2)[0]]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    ref = plain_generate(student, ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    fast = fast_generate(student, ids, mask, max_new_tokens=16, pad_token_id=0)
    assert torch.equal(fast, ref)
    for i, p in enumerate(prompts):
        alone = fast_generate(student, p[None], max_new_tokens=16, pad_token_id=0)
        assert torch.equal(fast[i, width:], alone[0, len(p):])


@pytest.mark.parametrize("variant", VARIANTS, ids=ID)
def test_options_change_the_model_and_survive_save_load(tiny_model, tmp_path, variant):
    student = _student(tiny_model, variant)
    plain = _student(tiny_model, {})
    ids = _ids(1, 24)
    logits = student(ids).logits
    assert (logits - plain(ids).logits).abs().max() > 1e-4  # the option is not a no-op
    tok = __import__("helpers").tiny_tokenizer()
    linearize.save(student, tok, tmp_path / "s")
    loaded, _ = linearize.load(tmp_path / "s", dtype=torch.float64)
    assert linearize.spec_of(loaded).decay == linearize.spec_of(student).decay
    torch.testing.assert_close(loaded(ids).logits, logits, atol=1e-12, rtol=0)


def test_trainable_gates_are_new_parameters(tiny_model):
    student = _student(tiny_model, {"decay": "gated"})
    names = {n for m in mixers(student).values() for n, _ in m.new_parameters()}
    assert {"gate_bias", "gate_proj.weight", "window_logit"} <= names


def _state_norms(student, ids, lengths):
    out = []
    for n in lengths:
        cache = LinearizeCache(student)
        with torch.no_grad():
            student(ids[:, :n], past_key_values=cache, use_cache=True, logits_to_keep=1)
        state = cache.layers[0].state
        out.append(state.linear[..., -1].sum().item())  # the mass sum phi_k(k_s) (the normaliser's column)
    return out


def test_a_fading_state_stays_bounded_to_32k_tokens(tiny_model):
    """Past the horizons the gated state's mass stops growing; the plain hybrid's grows with the length
    (and outweighs the window's ever more: what breaks it past the training length)."""
    ids = torch.randint(2, 97, (1, 32768), generator=torch.Generator().manual_seed(0))
    lengths = (2048, 8192, 32768)
    gated = _state_norms(_student(tiny_model, {"decay": "span"}, dtype=torch.float32, window=16, horizon=256), ids,
                         lengths)
    plain = _state_norms(_student(tiny_model, {}, dtype=torch.float32, window=16), ids, lengths)
    assert max(gated) < 1.1 * min(gated), gated
    assert plain[-1] > 4 * plain[0], plain


def test_fused_decode_step_takes_the_options():
    """The one-launch decode step with gates and features before RoPE, on the CPU by Triton's interpreter:
    the fast decoder's tokens equal those of its PyTorch ring step (each option on Llama; soft-capping,
    partial RoPE and a layer without RoPE with both), left padding included."""
    run_triton_interpreter_script("triton_interpret_hybrid_fused.py", "length")
