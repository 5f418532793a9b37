"""Measuring to 32k tokens: the by-position buckets to 32k against a stub whose loss at each position
is known exactly (whole and time-sliced output layer), short documents joined into long blocks,
students scored and prompted past their config's ``max_position_embeddings`` while softmax models
stop at it, mqar prompts past 8k, and the report's position table and plot with a 32k record."""

import importlib
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import linearize
from linearize.errors import LinearizeError
from linearize.eval.perplexity import perplexity_by_position, position_losses, source_blocks, token_nll

from helpers import decode_incrementally, tiny_tokenizer
from linearize.eval.recall import run_recall
from linearize.eval.tasks import mqar, needle
from test_recall import bpe, bpe_llama, eval_cli  # noqa: F401  (bpe: test_recall's tokenizer fixture)

ppl = importlib.import_module("linearize.eval.perplexity")  # the module (linearize.eval.perplexity is a function)
EDGES_32K = [0, 256, 1024, 4096, 8192, 16384, 32768]
RANGES_32K = ["0-256", "256-1k", "1k-4k", "4k-8k", "8k-16k", "16k-32k"]


# ----------------------------------------------------------------------------- a model whose loss is known


class _Trunk(nn.Module):
    """Hidden state ``(1, log(q + 1))`` at position ``q``, whatever the tokens."""

    def forward(self, ids, use_cache=False, **kwargs):
        q = torch.arange(ids.shape[1], dtype=torch.float64)
        hidden = torch.stack([torch.ones_like(q), torch.log1p(q)], -1)
        self.lengths.append(ids.shape[1])
        return SimpleNamespace(last_hidden_state=hidden.expand(ids.shape[0], -1, -1))


class PositionStub(nn.Module):
    """Logits 0 everywhere but ``log(q + 1)`` for token 0 at position ``q``: the token at position
    ``p >= 1`` (predicted at ``p - 1``) costs ``log(V - 1 + p) - [token == 0] * log(p)`` nats."""

    def __init__(self, vocab: int, context: int = 8192, student: bool = False):
        from transformers import PretrainedConfig

        super().__init__()
        self.config = PretrainedConfig(vocab_size=vocab, max_position_embeddings=context)
        if student:
            self.config.linearize = {"spec": {"kind": "stub"}}
        self.trunk = _Trunk()
        self.trunk.lengths = []
        self.lm_head = nn.Linear(2, vocab, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.lm_head.weight.zero_()
            self.lm_head.weight[0, 1] = 1.0
        self.widest = 0  # most logits one output-layer call made
        self.lm_head.register_forward_hook(lambda m, a, out: setattr(self, "widest", max(self.widest, out.numel())))

    @property
    def base_model(self):
        return self.trunk

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, ids, use_cache=False, **kwargs):
        return SimpleNamespace(logits=self.lm_head(self.trunk(ids).last_hidden_state))


def expected_nll(blocks: torch.Tensor, vocab: int) -> list[list[float]]:
    """Per block, the known loss of the token at each position ``p >= 1`` (index ``p - 1``)."""
    return [[math.log(vocab - 1 + p) - (math.log(p) if row[p] == 0 else 0.0) for p in range(1, len(row))]
            for row in blocks.tolist()]


def expected_buckets(blocks, vocab, edges):
    losses = expected_nll(blocks, vocab)
    out = []
    for lo, hi in zip(edges, edges[1:]):
        values = [x for row in losses for x in row[max(lo, 1) - 1 : hi - 1]]
        out.append((math.fsum(values), len(values)))
    return out


@pytest.mark.parametrize("budget", [None, 3 * 5000], ids=["whole-forward", "time-sliced"])
def test_buckets_to_32k_are_the_known_loss_per_position(budget, monkeypatch):
    """Two blocks of 32,768 tokens: every bucket's summed loss and token count equal the stub's known
    per-position loss; with a small LOGIT_BUDGET the output layer runs over slices of time (not
    aligned with the buckets), never more logits at once than the budget, with the same numbers."""
    vocab = 3
    if budget is not None:
        monkeypatch.setattr(ppl, "LOGIT_BUDGET", budget)
    model = PositionStub(vocab)
    blocks = torch.randint(0, vocab, (2, 32768), generator=torch.Generator().manual_seed(0))
    rows = position_losses(model, blocks, EDGES_32K, batch_size=2, progress=False)
    want = expected_buckets(blocks, vocab, EDGES_32K)
    assert [c for _, c in rows] == [2 * 255, 2 * 768, 2 * 3072, 2 * 4096, 2 * 8192, 2 * 16384]
    assert [c for _, c in rows] == [c for _, c in want]
    for (total, _), (truth, _) in zip(rows, want):
        assert total == pytest.approx(truth, rel=1e-12)
    means = [t / c for t, c in rows]
    assert means == sorted(means)  # the known loss rises with position: the buckets are not shuffled
    if budget is None:
        assert model.widest == 2 * 32768 * vocab  # one forward of both rows
    else:
        assert model.widest <= budget and max(model.trunk.lengths) == 32768
        assert model.widest == 5000 * vocab  # slices of LOGIT_BUDGET // vocab positions


def test_time_sliced_loss_equals_the_whole_forward_on_real_models(tiny_model, monkeypatch):
    """Llama, Gemma 2 (a final logit soft-cap) and GPT-NeoX, and a converted student: the losses from
    hidden states and a sliced output layer are the whole forward's; a model whose logits are not
    its output layer's on its hidden states (here scaled) falls back to the whole forward."""
    ids = torch.randint(0, 97, (2, 200), generator=torch.Generator().manual_seed(1))
    teacher = tiny_model("llama", dtype=torch.float64)
    models = {family: tiny_model(family, dtype=torch.float64, **extra)
              for family, extra in [("gemma2", {"final_logit_softcapping": 3.0}), ("gpt_neox", {})]}
    models["llama"] = teacher
    models["student"] = linearize.convert(teacher, {"kind": "lolcats", "window": 8})
    for name, model in models.items():
        whole = token_nll(model, ids)
        with monkeypatch.context() as m:
            m.setattr(ppl, "LOGIT_BUDGET", 97 * 37)
            assert ppl.output_head(model, ids[:1, :8]) is not None, name
            sliced = token_nll(model, ids)
        assert sliced.shape == whole.shape == (2, 199)
        torch.testing.assert_close(sliced, whole, rtol=1e-12, atol=1e-12, msg=name)
    gemma = models["gemma2"]
    gemma.config.final_logit_softcapping = None  # the head would now differ from the model's forward...
    forward = type(gemma).forward

    class Scaled(type(gemma)):  # ...and so does a family that scales its logits after the output layer
        def forward(self, *args, **kwargs):
            out = forward(self, *args, **kwargs)
            out.logits = out.logits * 0.5
            return out

    gemma.__class__ = Scaled
    with monkeypatch.context() as m:
        m.setattr(ppl, "LOGIT_BUDGET", 97 * 37)
        assert ppl.output_head(gemma, ids[:1, :8]) is None
        fallback = token_nll(gemma, ids)
    logits = gemma(ids).logits.double()
    manual = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    torch.testing.assert_close(fallback, manual, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- long blocks from short documents


def short_documents(folder, n=460, seed=0):
    """``n`` documents of 20-300 words of the tiny tokenizer (ids 20..96), one file each; their ids."""
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir()
    docs = []
    for i in range(n):
        length = int(torch.randint(20, 300, (1,), generator=gen))
        ids = torch.randint(20, 97, (length,), generator=gen).tolist()  # not w1x: "w1" (EOS) would split it
        (folder / f"doc{i:04d}.txt").write_text(" ".join(f"w{t}" for t in ids))
        docs.append(ids)
    return docs


@pytest.fixture
def documents(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    folder = tmp_path / "docs"
    return folder, short_documents(folder)


def test_short_documents_join_into_32k_blocks_and_a_short_split_is_one_line(documents):
    """460 documents of at most 300 tokens make two 32,768-token blocks: each row is the next stretch
    of the documents in order with EOS between them; a split shorter than one block is one error
    line saying how many tokens it has."""
    folder, docs = documents
    tok = tiny_tokenizer()
    eos = tok.eos_token_id
    stream = [t for i, d in enumerate(docs) for t in ([eos] if i else []) + d]
    assert max(map(len, docs)) < 300 and len(stream) >= 2 * 32768
    blocks = source_blocks(folder, tok, 32768, "all")
    assert blocks.shape == (len(stream) // 32768, 32768) == (2, 32768)
    assert blocks.flatten().tolist() == stream[: 2 * 32768]
    assert (blocks == eos).sum(1).min() > 32768 // 300  # each block spans well over a hundred documents
    from linearize.data.splits import split_documents

    texts = [(folder / f"doc{i:04d}.txt").read_text() for i in range(len(docs))]
    held = [d for d, t in zip(docs, texts) if t in split_documents(texts, 0.05, 0)["validation"]]
    tokens = sum(map(len, held)) + len(held) - 1
    with pytest.raises(LinearizeError) as err:
        perplexity_by_position(PositionStub(97, student=True), tok, folder, block_len=32768, split="validation",
                               progress=False)
    message = str(err.value)
    assert "\n" not in message and message.startswith("perplexity by position needs 32768-token blocks")
    assert f"gives {tokens} tokens, fewer than one block" in message and 0 < tokens < 32768


def test_by_position_to_32k_on_joined_documents_student_runs_past_its_context_softmax_stops(documents):
    """The stub as a student (context 8,192) scores 32k blocks of the joined documents in six buckets,
    each the known loss; as a softmax model it stops at its context, the later buckets said left out."""
    folder, docs = documents
    tok = tiny_tokenizer()
    stream_len = sum(map(len, docs)) + len(docs) - 1  # EOS between documents
    student = perplexity_by_position(PositionStub(97, student=True), tok, folder, block_len=32768, progress=False)
    blocks = source_blocks(folder, tok, 32768, "all")
    assert student["block_len"] == student["position_len"] == 32768 and student["context"] == 8192
    assert student["blocks"] == stream_len // 32768 == 2 and student["student"] is True and "left_out" not in student
    assert [b["range"] for b in student["buckets"]] == RANGES_32K
    for b, (total, count) in zip(student["buckets"], expected_buckets(blocks, 97, EDGES_32K)):
        assert b["tokens"] == count and b["loss"] == pytest.approx(total / count, rel=1e-12)
        assert b["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-12)
    teacher = perplexity_by_position(PositionStub(97), tok, folder, block_len=32768, progress=False)
    assert teacher["block_len"] == 8192 and teacher["position_len"] == 32768
    assert teacher["blocks"] == stream_len // 8192
    assert [b["range"] for b in teacher["buckets"]] == RANGES_32K[:4]
    assert teacher["left_out"] == ["8k-16k", "16k-32k"] and "8192-token context" in teacher["note"]
    default = perplexity_by_position(PositionStub(97, student=True), tok, folder, progress=False)
    assert default["block_len"] == 8192 and [b["range"] for b in default["buckets"]] == RANGES_32K[:4]
    assert default["buckets"][0]["loss"] == pytest.approx(teacher["buckets"][0]["loss"], rel=1e-12)


# ----------------------------------------------------------------------------- a real student past its context


def test_rotary_positions_past_the_context_are_the_rope_formula(tiny_model):
    """HF's rotary embedding computes cos/sin for any position: past max_position_embeddings (256)
    they are still cos(p * theta^(-2i/d)) (to float32's angles: HF computes them in float32)."""
    model = tiny_model("llama", dtype=torch.float64)
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    positions = torch.tensor([[0, 255, 256, 1000, 32767]])
    cos, sin = model.model.rotary_emb(torch.zeros(1, 5, d, dtype=torch.float64), positions)
    inv = cfg.rope_parameters["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[0, :, None].double() * inv
    torch.testing.assert_close(cos[0], torch.cat([angles, angles], -1).cos(), rtol=0, atol=2e-3)
    torch.testing.assert_close(sin[0], torch.cat([angles, angles], -1).sin(), rtol=0, atol=2e-3)
    assert (cos[0, 3] - cos[0, 1]).abs().max() > 0.5  # position 1000 is not clamped to the context


def test_converted_student_scores_and_decodes_past_its_context(tiny_model, tmp_path, monkeypatch, capsys):
    """A tiny Llama (max_position_embeddings 256) converted to LoLCATs: by position on 1,024-token
    blocks it gets the 256-1k bucket (its teacher stops at 256); its cached decoding past 256 tokens
    matches the parallel forward; `eval --position-len 1k` records the same, and for the teacher says
    that its blocks stop at its context."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    folder = tmp_path / "docs"
    short_documents(folder, n=40)
    tok = tiny_tokenizer()
    teacher = tiny_model("llama", dtype=torch.float64)
    student = linearize.convert(teacher, {"kind": "lolcats", "window": 8})
    assert teacher.config.max_position_embeddings == student.config.max_position_embeddings == 256
    row = perplexity_by_position(student, tok, folder, block_len=1024, progress=False)
    assert row["block_len"] == 1024 and [b["range"] for b in row["buckets"]] == ["0-256", "256-1k"]
    blocks = source_blocks(folder, tok, 1024, "all")
    assert row["buckets"][1]["tokens"] == blocks.shape[0] * 768 and math.isfinite(row["buckets"][1]["loss"])
    with torch.no_grad():
        logits = student(blocks).logits
    manual = torch.nn.functional.cross_entropy(logits[:, 255:-1].transpose(1, 2), blocks[:, 256:])
    assert row["buckets"][1]["loss"] == pytest.approx(manual.item(), rel=1e-10)
    capped = perplexity_by_position(teacher, tok, folder, block_len=1024, progress=False)
    assert capped["block_len"] == 256 and capped["left_out"] == ["256-1k"]
    ids = blocks[:1, :400]
    with torch.no_grad():
        torch.testing.assert_close(decode_incrementally(student, ids, prefill=300), student(ids).logits)

    linearize.save(student, tok, tmp_path / "student")
    out = tmp_path / "pos.json"
    assert eval_cli(["eval", str(tmp_path / "student"), "--by-position", "--position-len", "1k", "--no-perplexity",
                     "--source", str(folder), "--device", "cpu", "--dtype", "float64", "--quiet",
                     "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["settings"]["position_len"] == 1024
    saved = record["perplexity_by_position"]
    assert saved["block_len"] == 1024 and [b["range"] for b in saved["buckets"]] == ["0-256", "256-1k"]
    assert saved["buckets"][1]["loss"] == pytest.approx(row["buckets"][1]["loss"], rel=1e-9)
    teacher.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    capsys.readouterr()
    assert eval_cli(["eval", str(tmp_path / "teacher"), "--by-position", "--position-len", "1024", "--no-perplexity",
                     "--source", str(folder), "--device", "cpu", "--quiet", "--out", str(out)]) == 0
    assert "(a softmax model: blocks capped at the model's 256-token context (asked 1024); buckets 256-1k left out)" \
        in capsys.readouterr().out
    record = json.loads(out.read_text())["perplexity_by_position"]
    assert record["block_len"] == 256 and record["position_len"] == 1024 and record["left_out"] == ["256-1k"]
    with pytest.raises(LinearizeError, match="--position-len sets the block length of --by-position"):
        eval_cli(["eval", str(tmp_path / "student"), "--position-len", "32k", "--source", str(folder)])


# ----------------------------------------------------------------------------- recall past the context


def test_prompt_budget_keeps_a_students_lengths_past_the_context_whole():
    assert needle.prompt_budget((200, 256, 600), 256, 12, past_context=True) == [(200, 200), (256, 244), (600, 600)]
    assert needle.prompt_budget((200, 256, 600), 256, 12) == [(200, 200), (256, 244)]


def test_mqar_prompts_past_900_pairs_have_four_digit_numbers_and_the_short_ones_are_unchanged(bpe):
    """Up to 900 pairs the prompt is what it always was (two-word names, three-digit numbers: the
    old generator written out here); past 900 the numbers have four digits (900 three-digit ones
    would run out) and past 2,048 names get a third word; every answer once before its query."""
    import random

    rng = random.Random("mqar:5:40:0:3")  # needle.trial_rng's seed string for (seed 5, N 40, prompt 3)
    pool = len(mqar.COLOURS) * len(mqar.THINGS)
    keys = [f"{mqar.COLOURS[i // len(mqar.THINGS)]} {mqar.THINGS[i % len(mqar.THINGS)]}"
            for i in rng.sample(range(pool), 40)]
    values = [str(v) for v in rng.sample(range(100, 1000), 40)]
    asked = rng.sample(range(40), 40)
    old = mqar.HEAD + "".join(f"{k}: {v}\n" for k, v in zip(keys, values)) + mqar.MIDDLE
    old += "".join(f"{keys[i]}: {values[i]}\n" for i in asked)
    assert mqar.make_prompt(bpe, 40, 3, seed=5).text == old
    for pairs, digits in ((900, 3), (901, 4), (2500, 4)):
        prompt = mqar.make_prompt(bpe, pairs, 0, seed=5)
        listed, _ = prompt.text.split(mqar.MIDDLE)
        lines = listed.splitlines()[1:]
        assert len(lines) == pairs and len({line.split(": ")[0] for line in lines}) == pairs
        assert {len(line.split(": ")[1]) for line in lines} == {digits}
        if pairs > pool:
            assert any(line.split(" ")[0] in mqar.SIZES for line in lines)
        numbers = re.findall(r"\d+", listed)
        for q in prompt.queries:
            assert numbers.count(q["value"]) == 1 and listed.count(f"\n{q['key']}: {q['value']}\n") == 1
    with pytest.raises(ValueError):
        mqar.make_prompt(bpe, mqar.MAX_PAIRS + 1, 0, seed=5)


def test_recall_runs_past_a_students_context_and_mqar_counts_distances_past_8k(bpe):
    """A model of context 256: the student runs passkey at 600 tokens (whole, not cut) and mqar with
    80 pairs, the teacher drops both; mqar with 1,000 pairs (distances past 8k) fills the 8k-16k
    distance bucket, where 8k-16k distances used to be counted as 4k-8k."""
    teacher = bpe_llama(bpe, context=256)
    student = linearize.convert(teacher, {"kind": "lolcats", "window": 4})
    out = {name: run_recall(model, bpe, ["passkey", "mqar"], limit=1, lengths=(200, 600), depths=(50,),
                            pairs=(4, 80), batch_size=2, progress=False)
           for name, model in (("teacher", teacher), ("student", student))}
    assert out["teacher"]["passkey"]["lengths"] == [200] and out["teacher"]["passkey"]["dropped_lengths"] == [600]
    assert out["student"]["passkey"]["lengths"] == [200, 600] and out["student"]["passkey"]["dropped_lengths"] == []
    assert 0.98 * 600 <= out["student"]["passkey"]["prompt_tokens"][1] <= 600
    assert out["teacher"]["mqar"]["pairs"] == [4] and out["teacher"]["mqar"]["dropped_pairs"] == [80]
    assert out["student"]["mqar"]["pairs"] == [4, 80] and out["student"]["mqar"]["prompt_tokens"][1] > 256
    assert out["student"]["mqar"]["distance_buckets"] == RANGES_32K[:4]  # short prompts: the columns to 8k
    far = mqar.make_prompt(bpe, 1000, 0, seed=1234)
    distances = [q["distance"] for q in far.queries]
    assert max(distances) >= 8192 and [mqar.bucket(d) for d in (8191, 8192, 16384, 40000)] == [3, 4, 5, 5]
    long = run_recall(student, bpe, ["mqar"], limit=1, pairs=(4, 1000), batch_size=1, progress=False)["mqar"]
    assert long["distance_buckets"] == RANGES_32K[:5] and long["prompt_tokens"][1] > 8192
    assert sum(long["queries"][1][4:]) == sum(d >= 8192 for d in distances) > 0
    assert long["queries"][1][3] == sum(4096 <= d < 8192 for d in distances)
    assert long["grid"][0][4] is None  # 4 pairs: no query that far


# ----------------------------------------------------------------------------- the report


def _record(name, kind, source, block_len, ppls, *, left_out=None, context=8192):
    edges = ppl.position_edges(block_len)
    buckets = [{"range": f"{ppl._short(lo)}-{ppl._short(hi)}", "start": lo, "end": hi, "tokens": 10,
                "loss": math.log(v), "perplexity": v} for (lo, hi), v in zip(zip(edges, edges[1:]), ppls)]
    pos = {"source": source, "split": "all", "block_len": block_len, "position_len": 32768, "context": context,
           "blocks": 4, "buckets": buckets}
    if left_out:
        pos["left_out"] = left_out
        pos["note"] = f"a softmax model: blocks capped at the model's {context}-token context (asked 32768); " \
                      f"buckets {', '.join(left_out)} left out"
    return {"format": "linearize-eval/1", "created": "2026-12-01T00:00:00+00:00", "settings": {},
            "model": {"name": name, "kind": kind, "model_type": "llama", "layers": 30, "source": name,
                      "fingerprint": "0" * 64},
            "perplexity": None, "tasks": {}, "average": None, "perplexity_by_position": pos}


def test_report_draws_position_curves_and_tables_buckets_to_32k(tmp_path):
    """A teacher cut at 8k, a student at 32k and one at 8k on the books, the student on speeches:
    the table has a column per bucket to 32k, "–" where a record has none, the teacher's cut noted;
    position.png has a panel per text, log axes, a curve per record, the teacher among them."""
    from linearize.eval.report import position_curves, write_report

    records = {
        "teacher": _record("teacher", "softmax", "gutenberg", 8192, [37.7, 25.9, 25.7, 24.1],
                           left_out=["8k-16k", "16k-32k"]),
        "long": _record("lolcats-long", "lolcats", "gutenberg", 32768, [33.0, 26.0, 27.5, 28.0, 29.0, 30.5]),
        "short": _record("lolcats", "lolcats", "gutenberg", 8192, [34.1, 27.2, 120.3, 456.2]),
        "sotu": _record("lolcats-long", "lolcats", "corpus:sotu", 32768, [31.0, 33.0, 39.0, 45.0, 52.0, 60.0]),
    }
    folder = tmp_path / "results"
    folder.mkdir()
    for name, record in records.items():
        (folder / f"{name}.json").write_text(json.dumps(record))
    page = write_report([folder], tmp_path / "report.md")
    table = page.split("## Perplexity by position")[1].split("\n\n")[1].splitlines()
    assert table[0] == ("| model | kind | text | " + " | ".join(f"ppl {r}" for r in RANGES_32K) + " |")
    rows = {line.split(" | ")[0].lstrip("| ") + " " + line.split(" | ")[2].split(" ")[0]: line for line in table[2:]}
    assert rows["lolcats-long gutenberg"].endswith("| 33.00 | 26.00 | 27.50 | 28.00 | 29.00 | 30.50 |")
    assert rows["lolcats gutenberg"].endswith("| 34.10 | 27.20 | 120.30 | 456.20 | – | – |")
    assert rows["teacher gutenberg"].endswith("| 37.70 | 25.90 | 25.70 | 24.10 | – | – |")
    assert "4 x 8192 tok *" in rows["teacher gutenberg"] and "4 x 32768 tok |" in rows["lolcats-long corpus:sotu"]
    assert "teacher: a softmax model: blocks capped at the model's 8192-token context" in page
    png = tmp_path / "report-figures" / "position.png"
    assert png.stat().st_size > 1000 and "report-figures/position.png" in page
    assert page.index("position.png") < page.index("## Figures") + 200  # the first figure

    panels = position_curves([(folder / f"{n}.json", r) for n, r in records.items()])
    assert list(panels) == ["gutenberg (all)", "corpus:sotu (all)"]
    books = {c["label"]: c for c in panels["gutenberg (all)"]}
    assert set(books) == {"teacher", "lolcats-long", "lolcats"} and books["teacher"]["context"] == 8192
    assert [p[2] for p in books["lolcats-long"]["points"]] == RANGES_32K
    from linearize.eval.plots import position_figure

    plt, fig, axes = position_figure(panels)
    plt.close(fig)
    assert len(axes) == 2 and all(ax.get_xscale() == "log" and ax.get_yscale() == "log" for ax in axes)
    curves = [[line for line in ax.get_lines() if not line.get_label().startswith("_")] for ax in axes]
    assert [len(c) for c in curves] == [3, 1]
    assert [t.get_text() for t in axes[0].get_xticklabels()] == RANGES_32K
    styles = {line.get_label(): line.get_linestyle() for line in curves[0]}
    assert styles == {"teacher (teacher)": "--", "lolcats-long": "-", "lolcats": "-"}
    cut = [line for line in axes[0].get_lines() if line.get_label().startswith("_")]
    assert len(cut) == 1 and list(cut[0].get_xdata()) == [8192, 8192]  # where the teacher's context ends
    teacher_line = [line for line in curves[0] if line.get_label() == "teacher (teacher)"][0]
    assert list(teacher_line.get_ydata()) == [37.7, 25.9, 25.7, 24.1]
    xs = list(teacher_line.get_xdata())
    assert xs == sorted(xs) and xs[0] == pytest.approx(16.0) and xs[-1] == pytest.approx((4096 * 8192) ** 0.5)
