"""Mixtures of sources (``a,b`` and ``a=W,b=W``) through ``load_blocks``, the entry point every recipe uses."""

import pytest
import torch

from linearize.cli import main
from linearize.data import load_blocks
from linearize.data.mixture import Part, interleave, mix, parse_mixture
from linearize.errors import LinearizeError

from helpers import tiny_tokenizer


@pytest.fixture(autouse=True)
def linearize_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "linearize-home"))


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def corpus(folder, first: int, n_docs: int, words: int = 40):
    """A folder of one-line documents whose token ids all lie in [first, first + 10): each source's
    blocks are recognisable by their ids."""
    folder.mkdir()
    for d in range(n_docs):
        (folder / f"doc{d:03d}.txt").write_text(" ".join(f"w{first + (d * 7 + i) % 10}" for i in range(words)))
    return folder


def source_of(blocks: torch.Tensor) -> list[int]:
    """Which corpus (by its first id, 10 or 50) each block comes from (EOS, id 1, aside)."""
    return [10 if int(row[row != 1].min()) < 50 else 50 for row in blocks]


@pytest.fixture
def two(tmp_path):
    return str(corpus(tmp_path / "a", 10, 40)), str(corpus(tmp_path / "b", 50, 120))


def test_parse():
    assert parse_mixture("a.txt") is None and parse_mixture(None) is None
    assert parse_mixture("x,y") == [Part("x", None), Part("y", None)]
    assert parse_mixture(" gutenberg = 2 , hf:wikitext:raw@train=0.5") == [Part(None, 2.0), Part("hf:wikitext:raw@train", 0.5)]
    for bad, fragment in [("a=1,b", "every source a weight or none"), ("a=x,b=1", "not a number"),
                          ("a=0,b=1", "positive"), ("a=-1,b=1", "positive"), ("a,,b", "empty source"),
                          ("a=1,a=2", "listed twice"), ("a=inf,b=1", "positive")]:
        with pytest.raises(LinearizeError, match=fragment):
            parse_mixture(bad)


def test_an_existing_path_with_a_comma_is_one_source(tmp_path):
    path = tmp_path / "notes,2024=final.txt"
    path.write_text("w3 w4 w5")
    assert parse_mixture(str(path)) is None


def test_interleave_keeps_every_row_and_spreads_them_by_share():
    a, b = torch.zeros(4, 2, dtype=torch.long), torch.ones(12, 2, dtype=torch.long)
    mixed = interleave([a, b], [1.0, 3.0])
    assert mixed.shape == (16, 2) and int(mixed[:, 0].sum()) == 12
    assert mixed[:4, 0].tolist().count(0) == 1 and mixed[:8, 0].tolist().count(0) == 2  # a quarter of any prefix


def test_without_weights_every_block_once(two, tok):
    a, b = two
    for split in ("train", "validation"):
        parts = [load_blocks(s, tok, block_len=16, split=split) for s in two]
        mixed = load_blocks(f"{a},{b}", tok, block_len=16, split=split)
        assert mixed.shape[0] == sum(p.shape[0] for p in parts)
        assert sorted(map(tuple, mixed.tolist())) == sorted(map(tuple, torch.cat(parts).tolist()))


def test_weights_are_shares_of_the_training_blocks(two, tok):
    a, b = two
    n_a, n_b = (load_blocks(s, tok, block_len=16).shape[0] for s in two)
    mixed = load_blocks(f"{a}=1,{b}=1", tok, block_len=16)
    assert abs(mixed.shape[0] - (n_a + n_b)) <= 1  # as many as the sources together (each share rounded)
    counts = source_of(mixed)
    assert abs(counts.count(10) - (n_a + n_b) / 2) <= 1  # the small source repeated up to half
    assert counts[:10].count(10) == 5  # interleaved: any prefix follows the weights
    rows_a = {tuple(r) for r in load_blocks(a, tok, block_len=16).tolist()}
    assert {tuple(r) for r, s in zip(mixed.tolist(), counts) if s == 10} == rows_a  # every block of a, repeated
    # deterministic for a seed; another seed chooses other blocks of the larger source
    assert torch.equal(mixed, load_blocks(f"{a}=1,{b}=1", tok, block_len=16))
    assert not torch.equal(mixed, load_blocks(f"{a}=1,{b}=1", tok, block_len=16, seed=1))
    skewed = source_of(load_blocks(f"{a}=1,{b}=3", tok, block_len=16))
    assert abs(skewed.count(10) - (n_a + n_b) / 4) <= 1


def test_validation_is_never_repeated_and_its_prefix_follows_the_weights(two, tok):
    a, b = two
    val = [load_blocks(s, tok, block_len=16, split="validation") for s in two]
    mixed = load_blocks(f"{a}=1,{b}=1", tok, block_len=16, split="validation")
    assert sorted(map(tuple, mixed.tolist())) == sorted(map(tuple, torch.cat(val).tolist()))
    n = 2 * min(v.shape[0] for v in val)
    first = load_blocks(f"{a}=1,{b}=1", tok, block_len=16, split="validation", max_blocks=n)
    assert torch.equal(first, mixed[:n]) and source_of(first).count(10) == n // 2


def test_max_blocks_on_a_mixture(two, tok):
    a, b = two
    full = load_blocks(f"{a}=1,{b}=2", tok, block_len=16)
    some = load_blocks(f"{a}=1,{b}=2", tok, block_len=16, max_blocks=7)
    assert some.shape == (7, 16) and {tuple(r) for r in some.tolist()} <= {tuple(r) for r in full.tolist()}


def test_mix_of_one_source_is_that_source():
    blocks = torch.arange(12).view(6, 2)
    assert torch.equal(mix([Part("x", 2.0)], [blocks], "train", 0).sort(0).values, blocks)


def test_the_data_command_takes_a_mixture(two, tmp_path, capsys):
    a, b = two
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    assert main(["data", "--data", f"{a}=1,{b}=1", "--tokenizer", str(tmp_path / "tokenizer"), "--block-len", "16"]) == 0
    assert "train:" in capsys.readouterr().out
    assert main(["data", "--data", f"{a}=1,{tmp_path / 'missing'}=1", "--tokenizer", "no-such-teacher"]) == 2
    assert "missing" in capsys.readouterr().err  # checked before the tokenizer
