"""Recipes that learn from the teacher (``--loss kl | kl+lm``, SUPRA/XATL's ``--align-steps``, LoLCATs
stage 2's ``--loss``) on the tiny teacher: each lowers the distance to the teacher it trains on, and the
papers' LM loss stays the default."""

import json

import pytest

from linearize.cli import main


def _common(ws, out, steps=16):
    return ["--teacher", str(ws / "teacher"), "--data", str(ws / "corpus.jsonl"), "--out", str(out), "--budget", "cpu",
            "--block-len", "32", "--batch-size", "4", "--eval-blocks", "8", "--steps", str(steps), "--eval-steps", "4",
            "--lr", "3e-3", "--dtype", "float32", "--device", "cpu"]


def _evals(out, stage, key="eval_loss"):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if r["stage"] == stage and key in r]


@pytest.mark.parametrize("recipe", ["supra", "xatl"])
def test_kl_training_brings_the_student_toward_the_teacher(recipe, workspace, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    extra = ["--arch", "retnet", "--transfer", "embeddings,ffn"] if recipe == "xatl" else []
    assert main([recipe, *_common(workspace, tmp_path / "run"), *extra, "--loss", "kl+lm", "--kl-top-k", "16"]) == 0
    assert "trained on kl + next_token from a frozen copy of the teacher" in capsys.readouterr().out
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["loss"] == "kl + next_token"
    objective = _evals(tmp_path / "run", "uptrain")
    assert objective[-1] < objective[0] * 0.9, objective
    lm = _evals(tmp_path / "run", "uptrain", "eval_next_token")  # the LM loss is logged beside it
    assert len(lm) == len(objective) and lm[-1] < lm[0]
    ppl = results["perplexity"]
    assert ppl["student, after training"] < ppl["student, before training"]


def test_alignment_stage_fits_the_mixers_first(workspace, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    assert main(["supra", *_common(workspace, tmp_path / "run", steps=4), "--align-steps", "16", "--align-lr",
                 "1e-2"]) == 0
    assert "alignment stage: 16 steps" in capsys.readouterr().out
    align = _evals(tmp_path / "run", "align")
    assert len(align) == 4 and align[-1] < align[0] * 0.7, align
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["align"]["steps"] == 16 and results["train"]["steps"] == 20
    ppl = results["perplexity"]
    assert ppl["student, after alignment"] < ppl["student, before training"]
    assert (tmp_path / "run" / "align" / "train_config.json").exists()


def test_lolcats_stage_two_with_kl(workspace, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    args = ["lolcats", "--teacher", str(workspace / "teacher"), "--data", str(workspace / "corpus.jsonl"),
            "--out", str(tmp_path / "run"), "--budget", "cpu", "--block-len", "32", "--batch-size", "4",
            "--feature-dim", "8", "--window", "4", "--eval-blocks", "8", "--eval-steps", "4", "--dtype", "float32",
            "--device", "cpu", "--stage1-steps", "8", "--stage2-steps", "16", "--loss", "kl"]
    assert main(args) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["stage2"]["loss"] == "kl"
    kl = _evals(tmp_path / "run", "stage2")
    assert kl[-1] < kl[0], kl
    assert results["perplexity"]["after_stage2"] < results["perplexity"]["after_stage1"]


@pytest.mark.parametrize("argv, message", [
    (["supra", "--loss", "kl+bogus"], "unknown loss bogus"),
    (["xatl", "--loss", "kl", "--kl-temperature", "0"], "--kl-temperature must be positive"),
    (["supra", "--align-steps", "-1"], "--align-steps must be zero or more"),
    (["lolcats", "--loss", "kl", "--kl-top-k", "0"], "--kl-top-k must be a positive whole number"),
    (["lolcats", "--loss", "2*"], "cannot read the loss"),
])
def test_bad_distillation_settings_fail_before_the_teacher_loads(argv, message, tmp_path, capsys):
    assert main([*argv, "--teacher", str(tmp_path / "absent"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linearize: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_distillation_on_two_processes_equals_one(workspace, tmp_path):
    """The alignment stage and KL training with the frozen teacher on each of 2 gloo processes (half
    the batch each) log the losses of one process on the whole batch."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LINEARIZE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, batch, launcher in (("one", "8", [sys.executable, "-m", "linearize"]),
                                  ("two", "4", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                "--nproc_per_node", "2", "-m", "linearize"])):
        args = ["--teacher", str(workspace / "teacher"), "--data", str(workspace / "corpus.jsonl"),
                "--out", str(tmp_path / name), "--budget", "cpu", "--block-len", "32", "--batch-size", batch,
                "--train-blocks", "8", "--eval-blocks", "8", "--steps", "3", "--eval-steps", "1", "--lr", "3e-3",
                "--dtype", "float32", "--device", "cpu", "--align-steps", "2", "--loss", "kl+lm"]
        done = subprocess.run([*launcher, "supra", *args], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [(r["stage"], r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [r[:2] for r in runs["one"]] == [r[:2] for r in runs["two"]] and len(runs["one"]) == 5
    assert {r[0] for r in runs["one"]} == {"align", "uptrain"}
    for (_, _, a), (_, _, b) in zip(runs["one"], runs["two"]):
        assert a == pytest.approx(b, rel=2e-2)
    assert runs["one"][0][2] == pytest.approx(runs["two"][0][2], rel=1e-5)
