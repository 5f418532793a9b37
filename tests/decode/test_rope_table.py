"""The fast decoder's RoPE tables (``decode.fused.rope_table``, ``models.fusion.RopeTable``): the rotary embedding
read from tables of the positions below a call's total, built once by the module itself: the same bits as the
module for every family and RoPE type it takes (one table per layer type for Gemma 3), none for the RoPE types whose
frequencies follow the positions asked; in place for a decoding call, the module back after it; the same tokens."""

import pytest
import torch

from helpers import plain_generate, tiny_student

from linearize.decode import FastDecoder, fused
from linearize.models.fusion import RopeTable, rope_is_static

LOLCATS = {"kind": "lolcats", "window": 4, "feature_dim": 8}
SCALED = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}


def _tables(model, length, dtype):
    types = getattr(model.config.get_text_config(), "layer_types", None) or ()
    return RopeTable.of(model.base_model.rotary_emb, length, dtype, torch.device("cpu"), types)


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("llama", {"rope_parameters": SCALED}), ("qwen3", {}),
                                              ("mistral", {}), ("smollm3", {}), ("gemma3_text", {}),
                                              ("gpt_neox", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tables_give_the_modules_bits(tiny_model, family, overrides, dtype):
    model = tiny_model(family, **overrides)
    rotary = model.base_model.rotary_emb
    table = _tables(model, 40, dtype)
    assert table is not None and rope_is_static(rotary)
    positions = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(0))
    x = torch.zeros(3, 7, model.config.hidden_size, dtype=dtype)
    for kind in table.tables:
        want = rotary(x, positions) if kind is None else rotary(x, positions, kind)
        got = table(x, positions) if kind is None else table(x, positions, kind)
        assert all(torch.equal(g, w) and g.dtype == dtype for g, w in zip(got, want)), (family, kind)
    if family == "gemma3_text":  # one table per layer type
        assert set(table.tables) == {"sliding_attention", "full_attention"}
    other = torch.float64  # a dtype without a table: the module itself
    got = table(x.to(other), positions, *([next(iter(table.tables))] if None not in table.tables else []))
    assert got[0].dtype == other


def test_no_tables_for_frequencies_that_follow_the_positions(tiny_model):
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = tiny_model("llama", rope_parameters=dynamic)
    assert not rope_is_static(model.base_model.rotary_emb) and _tables(model, 40, torch.float32) is None
    with fused.rope_table(model, 40) as used:
        assert not used and not isinstance(model.base_model.rotary_emb, RopeTable)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_decoding_reads_the_tables_and_gives_the_same_tokens(tiny_model, family, monkeypatch):
    """With left padding: the fast decoder's tokens with the tables are those without them and generate()'s; the
    module runs only to build the tables (once per layer type), not a step; it is back after the call."""
    model = tiny_student(tiny_model, family, LOLCATS)
    rotary = model.base_model.rotary_emb
    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    calls = []
    rotary.register_forward_hook(lambda *a: calls.append(1))
    monkeypatch.setattr(fused, "ROPE_TABLE", False)
    without = FastDecoder(model, cuda_graph=False).generate(ids, mask, max_new_tokens=8, pad_token_id=0)
    per_call = len(calls)
    assert per_call >= 8  # the prefill and each of the 7 steps ask the module (once per layer type)
    monkeypatch.setattr(fused, "ROPE_TABLE", True)
    calls.clear()
    with_tables = FastDecoder(model, cuda_graph=False).generate(ids, mask, max_new_tokens=8, pad_token_id=0)
    types = len(set(getattr(model.config, "layer_types", None) or [None]))
    assert len(calls) == types  # building the tables, nothing after
    assert torch.equal(with_tables, without)
    ref = plain_generate(model, ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(with_tables, ref)
    assert model.base_model.rotary_emb is rotary
