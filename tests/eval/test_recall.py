"""Recall and long-context evaluation: the passkey / niah / mqar generators and their scoring, the
batched greedy decoding they run on, perplexity by position, whole-file perplexity, the recall
report and ``eval --out`` checked up front.

Fast tests use a small byte-level BPE trained here (a real tokenizer whose merges make token
counts differ from word counts) and tiny random Llamas of its vocabulary; the ``slow`` ones use
the real SmolLM2-135M-Instruct teacher, its tokenizer and the Gutenberg validation books.
"""

import json
import math
import re
import time

import pytest
import torch

import linearize
from linearize.errors import LinearizeError
from linearize.eval.perplexity import perplexity, perplexity_by_position, position_losses
from linearize.eval.recall import _Generator, greedy_guesses, run_grid, run_recall
from linearize.eval.tasks import mqar, needle, niah, passkey, split_tasks

from helpers import tiny_config

PROSE = (
    "Captain Wentworth had no fortune. He had been lucky in his profession; but spending freely what had come "
    "freely, had realized nothing. But he was confident that he should soon be rich: full of life and ardour, he "
    "knew that he should soon have a ship, and soon be on a station that would lead to everything he wanted.\n"
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: once "
    "or twice she had peeped into the book her sister was reading, but it had no pictures or conversations in it. "
    "So she was considering in her own mind whether the pleasure of making a daisy-chain would be worth the "
    "trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran close by her.\n"
)


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE of 512 tokens trained on the tasks' own words and some prose."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [PROSE, passkey.HEAD + passkey.FILLER * 3 + passkey.TAIL, niah.HEAD + niah.TAIL + " ".join(niah.KEYS),
              mqar.HEAD + mqar.MIDDLE + " ".join(mqar.COLOURS + mqar.THINGS)]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def bpe_llama(tokenizer, seed=0, context=2048):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config("llama", vocab_size=len(tokenizer), max_position_embeddings=context,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config).eval()


# ----------------------------------------------------------------------------- generators


def needle_and_tail(module, trial):
    """The needle sentence and the question of a trial, as the task formats them."""
    if module is passkey:
        return module.NEEDLE.format(key=trial.answer), module.TAIL
    return module.NEEDLE.format(key=trial.extra["key"], value=trial.answer), module.TAIL.format(key=trial.extra["key"])


def grid_trials(module, tokenizer, lengths, depths, seed=7, **kwargs):
    return {(n, d, i): module.make_trial(tokenizer, n, n, d, i, seed, **kwargs)
            for n in lengths for d in depths for i in range(2)}


@pytest.mark.parametrize("task", ["passkey", "niah"])
def test_needle_prompts_are_deterministic_fit_their_length_and_hold_the_answer_once(bpe, task):
    module = {"passkey": passkey, "niah": niah}[task]
    kwargs = {"haystack": PROSE * 40} if task == "niah" else {}
    lengths, depths = (96, 256, 700, 1500), (0, 25, 50, 75, 100)
    trials = grid_trials(module, bpe, lengths, depths, **kwargs)
    again = grid_trials(module, bpe, lengths, depths, **kwargs)
    assert {k: (t.prompt, t.ids, t.answer) for k, t in trials.items()} == \
           {k: (t.prompt, t.ids, t.answer) for k, t in again.items()}  # deterministic from the seed
    other_seed = grid_trials(module, bpe, lengths[:1], depths[:1], seed=8, **kwargs)
    assert other_seed[(96, 0, 0)].answer != trials[(96, 0, 0)].answer
    assert len({t.answer for t in trials.values()}) > len(trials) // 2  # each trial draws its own answer
    for (n, d, i), t in trials.items():
        assert t.ids == bpe(t.prompt).input_ids
        assert 0.98 * n <= len(t.ids) <= n, (n, len(t.ids))
        assert t.prompt.count(t.answer) == 1 and re.findall(r"\d+", t.prompt).count(t.answer) == 1
        if task == "passkey":
            assert len(t.answer) == 5 and t.prompt.endswith("The pass key is")
        else:
            assert len(t.answer) == 7 and t.prompt.endswith(f"The special magic number for {t.extra['key']} is")
    for n in lengths:  # the needle moves from right after the head to right before the question
        cell = [trials[(n, d, 0)] for d in depths]
        places = [t.prompt.index(module.NEEDLE.split("{")[0]) for t in cell]  # where the needle starts
        assert places == sorted(places) and places[0] < places[-1], places
        first, last = cell[0], cell[-1]
        assert first.prompt[len(module.HEAD):].startswith(needle_and_tail(module, first)[0])
        assert last.prompt.endswith(" ".join(needle_and_tail(module, last)).replace(" \n", "\n"))


def test_prompt_budget_keeps_the_models_last_length_and_drops_longer_ones():
    rows = needle.prompt_budget((256, 512, 1024, 8192), max_positions=1024, reserve=12)
    assert rows == [(256, 256), (512, 512), (1024, 1012)]
    assert needle.prompt_budget((256,), None, 12) == [(256, 256)]


def test_grid_flags_parse_and_reject_nonsense():
    assert needle.parse_grid("256, 1k,2K,256", (), "--lengths") == (256, 1024, 2048)
    assert needle.parse_grid(None, (1, 2), "--lengths") == (1, 2)
    for bad in ("12a", "0", ",", "-5"):
        with pytest.raises(LinearizeError, match="--lengths"):
            needle.parse_grid(bad, (), "--lengths", low=16)
    with pytest.raises(LinearizeError, match="between 0 and 100"):
        needle.parse_grid("50,101", (), "--depths", low=0, high=100)


def test_mqar_prompts_are_deterministic_and_each_answer_precedes_its_query_once(bpe):
    for pairs in (1, 8, 40):
        prompt = mqar.make_prompt(bpe, pairs, 3, seed=5)
        assert prompt.ids == mqar.make_prompt(bpe, pairs, 3, seed=5).ids
        assert prompt.ids == bpe(prompt.text).input_ids
        assert len(prompt.queries) == min(pairs, mqar.MAX_QUERIES)
        assert len({q["key"] for q in prompt.queries}) == len(prompt.queries)
        listed, asked = prompt.text.split(mqar.MIDDLE)
        for q in prompt.queries:
            assert listed.count(f"\n{q['key']}: ") == 1 and re.findall(r"\d+", listed).count(q["value"]) == 1
            assert bpe.decode([prompt.ids[t] for t in q["positions"]]).strip() == q["value"]
            assert q["distance"] > 0 and prompt.ids[q["positions"][0] - q["distance"]] == prompt.ids[q["positions"][0]]
            before = bpe.decode(prompt.ids[: q["positions"][0]])
            assert re.findall(r"\d+", before).count(q["value"]) == 1  # the answer once before its query
    assert mqar.make_prompt(bpe, 8, 3, seed=5).text != mqar.make_prompt(bpe, 8, 4, seed=5).text
    assert [mqar.bucket(d) for d in (1, 255, 256, 1023, 1024, 5000, 9000, 20000, 40000)] == [0, 0, 1, 1, 2, 3, 4, 5, 5]
    assert mqar.bucket_names(4) == ["0-256", "256-1k", "1k-4k", "4k-8k"]
    assert mqar.bucket_names()[4:] == ["8k-16k", "16k-32k"]


def test_task_names_split_into_zero_shot_and_recall():
    assert split_tasks("recall") == ([], ["passkey", "niah", "mqar"])
    assert split_tasks("piqa,mqar,passkey,recall") == (["piqa"], ["mqar", "passkey", "niah"])
    assert split_tasks("all")[1] == []  # 'all' stays the zero-shot suite
    with pytest.raises(LinearizeError, match="unknown task 'needle'"):
        split_tasks("needle")


# ----------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("completion, right", [
    (" 12345.", True), ("12345", True), (" The pass key is 12345. Remember", True), (" 12345 and 67890", True),
    (" 1234", False), (" 123456", False), (" 67890 12345", False), ("", False), (" twelve", False),
    (" 12,345.", True), (" 123-45", False),
])
def test_answer_rule_is_the_first_number(completion, right):
    assert needle.is_correct(completion, "12345") is right


def test_answer_rule_ignores_thousands_separators_only_between_digits():
    assert needle.first_number(" 1,234,567, then 8") == "1234567"
    assert needle.first_number("no number") is None
    assert needle.first_number(", 42,") == "42"


def test_mqar_score_needs_every_token_of_the_value(bpe):
    prompt = mqar.make_prompt(bpe, 6, 0, seed=1)
    truth = list(prompt.ids)
    assert mqar.score(prompt, truth) == [True] * 6
    wrong = list(truth)
    first, second = prompt.queries[0], prompt.queries[1]
    wrong[first["positions"][-1]] = (truth[first["positions"][-1]] + 1) % len(bpe)  # last token of one value
    wrong[second["positions"][0] - 1] = -1  # a token before a value does not count
    assert mqar.score(prompt, wrong) == [False] + [True] * 5


class HandMade:
    """A generation stand-in answering right exactly at the chosen depths: checks the grid's counting."""

    def __init__(self, model, tokenizer, right_at):
        self.model, self.tokenizer, self.right_at = model, tokenizer, right_at
        self.decoder, self.fallback_reason, self.batches = "hand-made", None, []
        self.by_ids = {}

    def __call__(self, prompts, max_new_tokens):
        self.batches.append(len(prompts))
        return [self.by_ids[tuple(p)] for p in prompts]


def test_grid_counts_hand_made_answers_per_cell(bpe):
    model = bpe_llama(bpe, context=640)
    depths = (0, 50, 100)
    gen = HandMade(model, bpe, right_at={0, 100})
    for n, target in needle.prompt_budget((128, 512, 1024), 640, passkey.MAX_NEW_TOKENS):
        for d in depths:
            for i in range(3):
                t = passkey.make_trial(bpe, n, target, d, i, 11)
                answer = f" {t.answer}." if d in gen.right_at else (" 1" + t.answer if i else " I do not know.")
                gen.by_ids[tuple(t.ids)] = answer
    result = run_grid(passkey, gen, (128, 512, 1024), depths, trials=3, batch_size=4, seed=11, progress=False)
    assert result["lengths"] == [128, 512] and result["dropped_lengths"] == [1024]  # 1024 > the 640 context
    assert result["grid"] == [[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]] and result["correct"][0] == [3, 0, 3]
    assert result["value"] == pytest.approx(2 / 3) and result["by_depth"] == [1.0, 0.0, 1.0]
    assert gen.batches == [4, 4, 1] * 2  # one row's 9 prompts per batch run, 4 at a time
    assert result["examples"][0]["depth"] == 50 and result["examples"][0]["correct"] is False


# ----------------------------------------------------------------------------- decoding and teacher forcing


def test_batched_left_padded_decoding_equals_each_prompt_alone_for_teacher_and_student(bpe):
    teacher = bpe_llama(bpe)
    prompts = [bpe(t).input_ids for t in ("The grass is green. The sky", "Alice was beginning to get very tired of "
                                          "sitting by her sister on the bank", "What is the pass key?")]
    for model in (teacher, linearize.convert(teacher, {"kind": "lolcats", "window": 4})):
        gen = _Generator(model, bpe)
        batched = gen(prompts, 6)
        assert gen.decoder == "fast"
        assert batched == [gen([p], 6)[0] for p in prompts]
        plain = _Generator(model, bpe)
        plain.decoder = "generate"  # transformers' generate(): the same greedy tokens
        assert plain(prompts, 6) == batched


def test_teacher_forced_guesses_are_the_argmax_of_each_prompt_alone(bpe):
    model = bpe_llama(bpe)
    student = linearize.convert(model, "supra")
    prompts = [mqar.make_prompt(bpe, n, 0, seed=2) for n in (3, 9, 5)]
    ids = [p.ids for p in prompts]
    starts = [min(q["positions"][0] for q in p.queries) for p in prompts]
    for m in (model, student):
        guesses = greedy_guesses(m, ids, starts, "cpu")
        for p, start, g in zip(ids, starts, guesses):
            with torch.no_grad():
                alone = m(torch.tensor([p])).logits[0].argmax(-1).tolist()
            assert g[:start] == [None] * start and len(g) == len(p)
            assert g[start:] == alone[start - 1 : len(p) - 1]


def test_run_recall_on_a_tiny_model_records_every_grid(bpe):
    model = bpe_llama(bpe, context=400)
    out = run_recall(model, bpe, ["passkey", "niah", "mqar"], limit=2, lengths=(128, 256, 512), depths=(0, 100),
                     pairs=(2, 8, 100), batch_size=3, haystack=PROSE * 20, progress=False)
    assert list(out) == ["passkey", "niah", "mqar"]
    for name in ("passkey", "niah"):
        task = out[name]
        assert task["lengths"] == [128, 256] and task["dropped_lengths"] == [512] and task["trials"] == 2
        assert len(task["grid"]) == 2 and all(len(row) == 2 for row in task["grid"])
        assert all(0 <= v <= 1 for row in task["grid"] for v in row) and task["decoder"] == "fast"
    assert out["mqar"]["pairs"] == [2, 8] and out["mqar"]["dropped_pairs"] == [100]
    assert sum(map(sum, out["mqar"]["queries"])) == 2 * (2 + 8)
    with pytest.raises(LinearizeError, match="whole number of trials"):
        run_recall(model, bpe, ["passkey"], limit=0.5)


# ----------------------------------------------------------------------------- perplexity by position


def test_position_buckets_split_the_mean_loss_exactly(bpe):
    model = bpe_llama(bpe)
    blocks = torch.randint(2, len(bpe), (3, 64), generator=torch.Generator().manual_seed(0))
    edges = (0, 8, 32, 64)
    rows = position_losses(model, blocks, edges, batch_size=2, progress=False)
    assert [count for _, count in rows] == [3 * 7, 3 * 24, 3 * 32]  # position 0 has nothing to predict
    total = sum(s for s, _ in rows) / sum(c for _, c in rows)
    assert math.exp(total) == pytest.approx(perplexity(model, blocks, progress=False), rel=1e-5)
    with torch.no_grad():
        logp = torch.log_softmax(model(blocks).logits.double(), -1)
    manual = -sum(logp[b, p - 1, blocks[b, p]].item() for b in range(3) for p in range(8, 32)) / (3 * 24)
    assert rows[1][0] / rows[1][1] == pytest.approx(manual, rel=1e-5)


def test_perplexity_by_position_on_a_text_caps_blocks_at_the_context(bpe, tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    text = tmp_path / "book.txt"
    text.write_text(PROSE * 4)
    model = bpe_llama(bpe, context=300)
    result = perplexity_by_position(model, bpe, text, progress=False)
    assert result["block_len"] == 300 and result["split"] == "all"
    assert [b["range"] for b in result["buckets"]] == ["0-256", "256-300"]
    assert result["blocks"] == len(bpe(PROSE * 4).input_ids) // 300 >= 2
    with pytest.raises(LinearizeError, match="needs 300-token blocks"):
        small = tmp_path / "small.txt"
        small.write_text(PROSE[:200])
        perplexity_by_position(model, bpe, small, progress=False)


# ----------------------------------------------------------------------------- CLI: whole file, --out, report


def eval_cli(argv):
    """The eval/report commands on a parser like linearize/cli.py's (common --dtype/--device)."""
    import argparse

    from linearize.eval.cli import add_eval_commands

    parser = argparse.ArgumentParser(prog="linearize")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dtype")
    common.add_argument("--device")
    add_eval_commands(sub, common)
    args = parser.parse_args(argv)
    return args.func(args)


def test_eval_source_file_scores_every_block(bpe, tmp_path, monkeypatch, capsys):
    """A user's file is scored whole (25 blocks here), not its validation split (1 block)."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    model = linearize.convert(bpe_llama(bpe), {"kind": "lolcats", "window": 4})
    linearize.save(model, bpe, tmp_path / "student")
    ids = bpe(PROSE * 8).input_ids
    block = len(ids) // 25
    text = tmp_path / "file.txt"
    text.write_text(PROSE * 8)
    common = [str(tmp_path / "student"), "--source", str(text), "--block-len", str(block), "--device", "cpu", "--quiet"]
    assert eval_cli(["eval", *common, "--out", str(tmp_path / "all.json")]) == 0
    record = json.loads((tmp_path / "all.json").read_text())
    assert record["perplexity"]["blocks"] == 25 and record["perplexity"]["split"] == "all"
    assert record["perplexity"]["tokens_scored"] == 25 * (block - 1)
    assert "all of it: 25 blocks" in capsys.readouterr().out
    assert eval_cli(["eval", *common, "--split", "validation", "--out", str(tmp_path / "val.json")]) == 0
    assert json.loads((tmp_path / "val.json").read_text())["perplexity"]["blocks"] == 1
    with pytest.raises(LinearizeError, match="--split all needs --source"):
        eval_cli(["eval", str(tmp_path / "student"), "--split", "all"])


def test_eval_out_is_checked_before_the_model_loads(tmp_path, capsys):
    """`eval --out DIR` (and an --out under a file) fail at once with one line, exit 2: the model
    named here does not exist, so reaching the model load would print another error."""
    from linearize.cli import main

    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    for out, message in [(tmp_path / "folder", "is a folder"), (tmp_path / "file" / "r.json", "is a file")]:
        start = time.perf_counter()
        assert main(["eval", str(tmp_path / "no-such-model"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("linearize: error: --out") or "cannot write" in err
        assert message in err and err.count("\n") == 1 and time.perf_counter() - start < 5
    assert main(["eval", str(tmp_path / "no-such-model"), "--tasks", "passkey", "--limit", "0.5"]) == 2
    assert "whole number of trials" in capsys.readouterr().err


def test_recall_report_tables_heat_maps_and_recovery(bpe, tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    from linearize.eval import evaluate, save_results, write_report

    text = tmp_path / "book.txt"
    text.write_text(PROSE * 3)
    teacher = bpe_llama(bpe, context=300)
    models = {"teacher": teacher, "lolcats": linearize.convert(teacher, {"kind": "lolcats", "window": 4})}
    paths = {}
    for name, model in models.items():
        record = evaluate(model, bpe, tasks="passkey,mqar", limit=1, source=text, block_len=256, lengths=(96, 128),
                          depths=(0, 100), pairs=(2, 4), name=name, by_position=True, progress=False)
        paths[name] = save_results(record, tmp_path / "results" / f"{name}.json")
    # the tiny random models score ~0: set known scores to check the recovery arithmetic (and zero-shot
    # scores as lm-eval records them, which this test does not run)
    for name, (pk, mq, piqa, arc) in {"teacher": (0.8, 0.5, 0.6, 0.5), "lolcats": (0.2, 0.5, 0.57, 0.4)}.items():
        record = json.loads(paths[name].read_text())
        record["recall"]["passkey"]["value"], record["recall"]["mqar"]["value"] = pk, mq
        record["tasks"] = {"piqa": {"value": piqa}, "arc_easy": {"value": arc}}
        record["average"] = (piqa + arc) / 2
        paths[name].write_text(json.dumps(record))
    page = write_report([tmp_path / "results"], tmp_path / "report.md")
    recovery_rows = page.split("Recovery vs teacher")[1].split("\n\n")[1].splitlines()
    assert recovery_rows[0] == "| model | teacher | PIQA | ARC-e | recovery (avg) |"
    assert recovery_rows[2:] == ["| lolcats | teacher | 95.0 | 80.0 | 88.2 |"]  # 0.485 / 0.55
    recall_rows = page.split("## Recall")[1].split("\n\n")[1].splitlines()
    assert recall_rows[0] == "| model | kind | passkey | mqar | avg | recovery |"
    assert recall_rows[2] == "| lolcats | lolcats | 20.0 | 50.0 | 35.0 | 53.8 |"  # 0.35 / 0.65
    assert recall_rows[3] == "| teacher | softmax | 80.0 | 50.0 | 65.0 | – |"
    assert "**passkey** by prompt length" in page and "tokens: 128" in page and "N = 4" in page
    assert "## Perplexity by position" in page and "ppl 0-256" in page and "ppl 256-300" in page
    for name in ("teacher", "lolcats"):
        png = tmp_path / "report-figures" / f"{name}-recall.png"
        assert png.stat().st_size > 1000 and f"report-figures/{name}-recall.png" in page
    with pytest.raises(LinearizeError, match="no softmax model named 'nobody'"):
        write_report([tmp_path / "results"], teacher="nobody")


# ----------------------------------------------------------------------------- the real teacher


@pytest.fixture(scope="module")
def teacher():
    return linearize.load_teacher(device="cpu", dtype="float32")


@pytest.mark.slow
def test_real_tokenizer_prompts_fit_the_default_grid(teacher):
    """SmolLM2's tokenizer: every default length (8192 shortened to fit the new tokens) within 2 %,
    the haystack from the validation books, the answer once."""
    _, tokenizer = teacher
    for (n, target) in needle.prompt_budget(needle.DEFAULT_LENGTHS, 8192, niah.MAX_NEW_TOKENS):
        for d in (0, 50, 100):
            for module in (passkey, niah):
                t = module.make_trial(tokenizer, n, target, d, 0, 1234)
                assert 0.98 * target <= len(t.ids) <= target and t.prompt.count(t.answer) == 1
    assert len(mqar.make_prompt(tokenizer, 512, 0, 1234).ids) < 8192


@pytest.mark.slow
def test_real_teacher_passes_passkey_at_512_tokens(teacher):
    """The embedded teacher repeats the pass key in at least 9 of 10 trials at 512 tokens (2 per depth)."""
    model, tokenizer = teacher
    start = time.perf_counter()
    result = run_recall(model, tokenizer, ["passkey"], limit=2, lengths=(512,), batch_size=10, progress=False)
    task = result["passkey"]
    correct = sum(task["correct"][0])
    print(f"\nteacher passkey at 512 tokens: {correct}/10 ({time.perf_counter() - start:.0f} s); "
          f"e.g. {task['examples'][0]}")
    assert task["prompt_tokens"][0] >= 0.98 * 512 and task["decoder"] == "fast"
    assert correct >= 9


def test_records_carry_state_bytes_and_the_report_draws_the_dial(tiny_model, tmp_path):
    """Each eval record states the model's decoding memory at 8k tokens (what `linearize info --length
    8192` reports); with recall results the report adds the memory-against-recall table and dial.png.
    The recall grids here are the GPU records of docs/gpu-runs/recall.jsonl, with the state bytes
    RESULTS.md gives for them (those records predate the field)."""
    from pathlib import Path

    from linearize.eval.report import dial_points, figures, render
    from linearize.eval.results import load_bundle, model_identity
    from linearize.info import state_bytes

    teacher = tiny_model("llama")
    student = linearize.convert(teacher, {"kind": "lolcats", "window": 4}, keep_softmax=[1])
    for model in (teacher, student):
        assert model_identity(model)["state_bytes_8k"] == state_bytes(model, 8192)["total"] > 0
    assert model_identity(student)["state_bytes_8k"] < model_identity(teacher)["state_bytes_8k"]

    raw = dict(load_bundle(Path(__file__).parents[2] / "docs" / "gpu-runs" / "recall.jsonl"))
    sizes = {"recall-teacher": 188_700_000, "recall-lolcats-s0": 5_940_000, "recall-lolcats-s64": 8_990_000,
             "recall-supra": 4_423_680}
    records = []
    for name, size in sizes.items():
        record = raw[Path(f"recall/{name}.json")]
        record["model"]["state_bytes_8k"] = size
        records.append((tmp_path / f"{name}.json", record))
    points = dial_points(records)
    assert [p["name"] for p in points] == ["supra", "lolcats-s0", "lolcats-s64", "teacher"]  # by memory
    teacher_point = points[-1]
    assert teacher_point["passkey_2k"] == pytest.approx(0.85) and teacher_point["passkey_8k"] == pytest.approx(0.6)
    page = render(records, title="dial")
    assert "## Memory against recall" in page and "| teacher | 188.70 MB | 85.0 | 60.0 | 81.0 | 28.34 |" in page
    made = figures(records, (), tmp_path)
    dial = [png for caption, png in made if caption.startswith("memory against recall")]
    assert len(dial) == 1 and dial[0].stat().st_size > 0
