"""The real embedded teacher (SmolLM2-135M-Instruct, dequantised from its GGUF): conversion is exact
where the math says so, checkpoints round-trip, and recurrent decoding matches parallel forwards."""

import pytest
import torch

import linearize
from helpers import greedy_by_full_forwards, plain_generate

pytestmark = pytest.mark.slow

TEXT = (
    "Captain Wentworth had no fortune. He had been lucky in his profession; but spending freely what had "
    "come freely, had realized nothing. But he was confident that he should soon be rich: full of life and "
    "ardour, he knew that he should soon have a ship, and soon be on a station that would lead to everything "
    "he wanted. He had always been lucky; he knew he should be so still. Such confidence, powerful in its own "
    "warmth, and bewitching in the wit which often expressed it, must have been enough for Anne."
)


@pytest.fixture(scope="module")
def teacher():
    model, tokenizer = linearize.load_teacher(dtype="float32", device="cpu")
    return model, tokenizer


@pytest.fixture(scope="module")
def ids(teacher):
    _, tokenizer = teacher
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] > 64
    return ids


def test_full_window_hybrid_reproduces_the_teacher(teacher, ids):
    model, _ = teacher
    with torch.no_grad():
        reference = model(ids).logits
        student = linearize.convert(model, {"kind": "lolcats", "window": ids.shape[1]})
        diff = (student(ids).logits - reference).abs().max().item()
    assert diff <= 1e-3, diff


def test_real_student_roundtrip_and_recurrent_decoding(teacher, ids, tmp_path):
    model, tokenizer = teacher
    student = linearize.convert(model, {"kind": "lolcats", "window": 16}, keep_softmax=[0])
    delta = linearize.convert(model, {"kind": "delta", "window": 16})  # the gated delta rule's ring
    with torch.no_grad():
        for mixer in linearize.mixers(delta).values():
            mixer.mix_proj.bias.fill_(0.0)  # the memory weighs half
    linearize.save(student, tokenizer, tmp_path / "ckpt")
    loaded, loaded_tok = linearize.load(tmp_path / "ckpt", device="cpu")
    assert loaded_tok.vocab_size == tokenizer.vocab_size
    prompt = ids[:, :40]
    with torch.no_grad():
        assert torch.equal(loaded(prompt).logits, student(prompt).logits)
        out = plain_generate(loaded, prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        reference = greedy_by_full_forwards(loaded, prompt, 12)
    assert torch.equal(out, reference)


def test_real_supra_decodes_like_its_parallel_form(teacher, ids):
    model, _ = teacher
    student = linearize.convert(model, "supra")
    with torch.no_grad():
        full = student(ids[:, :48], use_cache=False).logits
        out = student(ids[:, :40], use_cache=True)
        steps = [out.logits]
        for t in range(40, 48):
            out = student(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-3, rtol=1e-3)


def test_real_fast_decoding_equals_generate(teacher, ids):
    """linearize.fast on the real teacher's LoLCATs and gated delta-rule students (the ring window
    wraps twice) and on the teacher itself: the greedy tokens of generate(), also for a left-padded batch."""
    from linearize.fast import fast_generate

    model, tokenizer = teacher
    student = linearize.convert(model, {"kind": "lolcats", "window": 16}, keep_softmax=[0])
    delta = linearize.convert(model, {"kind": "delta", "window": 16})  # the gated delta rule's ring
    with torch.no_grad():
        for mixer in linearize.mixers(delta).values():
            mixer.mix_proj.bias.fill_(0.0)  # the memory weighs half
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    short, long_ = ids[0, 5:17], ids[0, :30]
    batch = torch.full((2, 30), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    batch[0], mask[0] = long_, 1
    batch[1, 18:], mask[1, 18:] = short, 1
    with torch.no_grad():
        for m in (student, delta, model):
            fast = fast_generate(m, batch, mask, max_new_tokens=32, eos_token_id=None, pad_token_id=pad)
            ref = plain_generate(m, batch, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=pad,
                                 eos_token_id=None)
            assert torch.equal(fast, ref)
            alone = fast_generate(m, short[None], max_new_tokens=32, eos_token_id=None, pad_token_id=pad)
            assert torch.equal(fast[1, 30:], alone[0, 12:])
