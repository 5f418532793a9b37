"""``data.repeats``: training blocks given a verbatim repeat of their own text (``--repeats``)."""

import types

import pytest
import torch

from linearize.data.repeats import MIN_GAP, SPAN, with_repeats
from linearize.errors import LinearizeError


def _blocks(n=40, length=1024, seed=0):
    return torch.randint(0, 50_000, (n, length), generator=torch.Generator().manual_seed(seed))


def _repeat_in(row_before, row_after):
    """(a, b, span) of the one rewritten span: the changed tokens lie in [b, b + span), and they equal an
    earlier span [a, a + span) of the row that ends at least MIN_GAP tokens before b."""
    changed = (row_before != row_after).nonzero().flatten()
    lo, hi = int(changed.min()), int(changed.max())
    for span in range(hi - lo + 1, SPAN[1] + 1):
        for b in range(max(0, hi - span + 1), lo + 1):
            piece = row_after[b : b + span]
            for a in range(0, b - span - MIN_GAP + 1):
                if torch.equal(row_after[a : a + span], piece):
                    return a, b, span
    return None


def test_a_share_of_the_blocks_repeats_a_span_past_the_gap_and_the_rest_is_untouched():
    blocks = _blocks()
    out = with_repeats(blocks, 0.25, seed=3)
    changed = [i for i in range(len(blocks)) if not torch.equal(out[i], blocks[i])]
    assert len(changed) == 10
    for i in changed:
        found = _repeat_in(blocks[i], out[i])
        assert found is not None, i
        a, b, span = found
        assert SPAN[0] <= span <= SPAN[1] and b - (a + span) >= MIN_GAP
    assert torch.equal(with_repeats(blocks, 0.25, seed=3), out)  # seeded
    assert not torch.equal(with_repeats(blocks, 0.25, seed=4), out)
    assert with_repeats(blocks, 0.0) is blocks
    assert torch.equal(blocks, _blocks())  # the input is not rewritten in place


def test_short_blocks_take_shorter_spans_and_bad_shares_are_refused():
    blocks = _blocks(n=8, length=160)
    out = with_repeats(blocks, 1.0, seed=0)
    for i in range(8):
        a, b, span = _repeat_in(blocks[i], out[i])
        assert span <= (160 - MIN_GAP) // 2
    with pytest.raises(LinearizeError, match="repeats"):
        with_repeats(blocks, 1.5)
    with pytest.raises(LinearizeError, match="longer than"):
        with_repeats(_blocks(n=2, length=MIN_GAP + 1), 1.0)


def test_recipes_rewrite_training_blocks_only(monkeypatch):
    from linearize.recipes import common

    calls = {}

    def fake_load_blocks(data, tokenizer, block_len, split, max_blocks=None, seed=0):
        calls[split] = _blocks(n=12, seed=1 if split == "train" else 2)
        return calls[split].clone()

    monkeypatch.setattr(common, "load_blocks", fake_load_blocks)
    cfg = types.SimpleNamespace(data=None, block_len=1024, train_blocks=None, eval_blocks=4, seed=0, repeats=0.5)
    train_ds, _, eval_blocks = common.datasets(cfg, tokenizer=None)
    assert not torch.equal(train_ds.blocks, calls["train"]) and torch.equal(eval_blocks, calls["validation"])
    cfg.repeats = 0.0
    train_ds, _, _ = common.datasets(cfg, tokenizer=None)
    assert torch.equal(train_ds.blocks, calls["train"])
