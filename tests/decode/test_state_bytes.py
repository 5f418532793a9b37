"""Decoding state per sequence at a given length (the memory dial's x axis): counted by
``info.state_bytes(model, length, batch)`` and ``linearize info --length``, checked against what a
cache really holds after generating that many tokens."""

import pytest
import torch

import linearize
from helpers import plain_generate, tiny_config, tiny_tokenizer
from linearize.cache import LinearizeCache, cache_nbytes
from linearize.cli import main
from linearize.info import state_bytes

WINDOW_FLAGS = 4  # bytes per converted layer: the window's padding flags, left out of state_bytes


@pytest.mark.parametrize("spec", [{"kind": "lolcats", "window": 4, "keep_softmax": [1]},
                                  {"kind": "lolcats", "window": 4, "sparse_cache": 3, "keep_softmax": [0]},
                                  {"kind": "delta", "window": 4, "keep_softmax": [2]}])
def test_state_bytes_at_a_length_is_what_the_cache_holds(tiny_model, spec):
    student = linearize.convert(tiny_model("llama"), spec)
    prompt = torch.ones(2, 6, dtype=torch.long)
    cache = LinearizeCache(student)
    plain_generate(student, prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, past_key_values=cache,
                   pad_token_id=0)
    length = 6 + 20 - 1  # the last token is never fed back
    mem = state_bytes(student, length, batch=2)
    assert mem["total"] == cache_nbytes(cache) - 2 * 2 * WINDOW_FLAGS
    assert mem["softmax"] == 2 * length * mem["per_token"] > 0
    assert state_bytes(student, 2 * length)["total"] - state_bytes(student, length)["total"] == length * mem["per_token"]


def test_the_teacher_is_all_kv_cache_and_a_linear_student_none(tiny_model):
    teacher = tiny_model("llama")
    cfg = teacher.config
    kv = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4 * cfg.num_hidden_layers
    assert state_bytes(teacher, 8192) == {"fixed": 0, "per_token": kv, "fast_fixed": 0, "length": 8192, "batch": 1,
                                          "softmax": 8192 * kv, "total": 8192 * kv}
    student = linearize.convert(teacher, "lolcats")
    assert state_bytes(student, 8192)["total"] == state_bytes(student)["fixed"]
    assert state_bytes(student, 8192, dtype=torch.bfloat16)["total"] < state_bytes(student, 8192)["total"]


def test_info_prints_the_state_at_a_length(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama"))
    student = linearize.convert(teacher, {"kind": "lolcats", "window": 4, "sparse_cache": 2, "keep_softmax": [1]})
    linearize.save(student, tiny_tokenizer(), tmp_path / "s")
    assert main(["info", str(tmp_path / "s"), "--length", "8192"]) == 0
    total = state_bytes(student, 8192)["total"]
    assert f"{total:,} bytes per sequence at 8,192 tokens" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "s"), "--length", "0"]) == 2
