"""The sparse cache and the delta-rule mixer on the real embedded teacher (SmolLM2-135M-Instruct):
a cache that holds every token leaving the window is the teacher again, and both decode through
``generate()`` exactly as their parallel forwards predict."""

import pytest
import torch

import linearize
from helpers import greedy_by_full_forwards, plain_generate

pytestmark = pytest.mark.slow

TEXT = (
    "Captain Wentworth had no fortune. He had been lucky in his profession; but spending freely what had "
    "come freely, had realized nothing. But he was confident that he should soon be rich: full of life and "
    "ardour, he knew that he should soon have a ship, and soon be on a station that would lead to everything "
    "he wanted."
)


@pytest.fixture(scope="module")
def teacher():
    model, tokenizer = linearize.load_teacher(dtype="float32", device="cpu")
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] > 48
    return model, ids


def test_a_cache_holding_every_older_token_is_the_teacher(teacher):
    model, ids = teacher
    with torch.no_grad():
        reference = model(ids).logits
        student = linearize.convert(model, {"kind": "lolcats", "window": 16, "sparse_cache": ids.shape[1]})
        diff = (student(ids).logits - reference).abs().max().item()
    assert diff <= 1e-3, diff


@pytest.mark.parametrize("spec", [{"kind": "lolcats", "window": 16, "sparse_cache": 8},
                                  {"kind": "delta", "window": 16}])
def test_generate_follows_the_parallel_forward(teacher, spec):
    model, ids = teacher
    student = linearize.convert(model, spec)
    student.generation_config.eos_token_id = None
    prompt = ids[:, :40]
    with torch.no_grad():
        out = plain_generate(student, prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(out, greedy_by_full_forwards(student, prompt, 6))
