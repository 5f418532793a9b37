"""What a checkpoint says about itself (teacher, training runs) through `linearize info` / `generate`,
and the checkpoint errors of issue 26 as one `linearize: error:` line, exit 2, no traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linearize.cli import main

from helpers import tiny_config, tiny_tokenizer

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def teacher_dir(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "teacher")
    tiny_tokenizer().save_pretrained(tmp_path / "teacher")
    return tmp_path / "teacher"


@pytest.fixture
def student_dir(teacher_dir, tmp_path, capsys):
    assert main(["convert", "--teacher", str(teacher_dir), "--out", str(tmp_path / "student"), "--kind", "lolcats",
                 "--window", "4", "--device", "cpu"]) == 0
    capsys.readouterr()
    return tmp_path / "student"


def test_untrained_conversion_is_shown_and_warned(student_dir, teacher_dir, capsys):
    assert main(["info", str(student_dir)]) == 0
    out = capsys.readouterr().out
    assert "model type:   linearize_llama (LinearizeLlamaForCausalLM)" in out
    assert f"teacher:      {teacher_dir.resolve()}" in out
    assert "training:     none: untrained conversion" in out
    assert main(["generate", str(student_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("linearize: warning:")]
    assert len(warnings) == 1 and "untrained conversion" in warnings[0]
    assert f"[linearize_llama from {teacher_dir.resolve()}]" in captured.err
    assert "untrained" not in captured.out  # the generated text alone on stdout


def test_a_recipe_records_its_training(workspace, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    assert main(["xatl", "--teacher", str(workspace / "teacher"), "--data", str(workspace / "corpus.jsonl"),
                 "--out", str(tmp_path / "x"), "--budget", "cpu", "--block-len", "32", "--batch-size", "4",
                 "--eval-blocks", "8", "--steps", "2", "--eval-steps", "2", "--dtype", "float32", "--device", "cpu",
                 "--arch", "retnet"]) == 0
    capsys.readouterr()
    record = json.loads((tmp_path / "x" / "final" / "config.json").read_text())["linearize"]
    (run,) = record["training"]
    assert run["recipe"] == "xatl" and run["tokens"] == 2 * 4 * 32 and run["steps"] == 2
    assert run["data"] == str(workspace / "corpus.jsonl") and run["date"][:2] == "20"
    assert record["teacher"] == str((workspace / "teacher").resolve())
    assert main(["info", str(tmp_path / "x" / "final")]) == 0
    assert "training:     xatl, 256 tokens, 20" in capsys.readouterr().out
    assert main(["generate", str(tmp_path / "x" / "final"), "--prompt", "w5 w6", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "training: xatl, 256 tokens" in err


def _run(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-m", "linearize", *args], capture_output=True, text=True, env=env,
                          timeout=300, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stderr


def _no_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)


def _no_spec(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    del config["linearize"]["spec"]
    (folder / "config.json").write_text(json.dumps(config))


def _weights_changed(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    name = next(k for k in tensors if "window_logit" in k)
    save_file({**tensors, name: tensors[name] + 1}, folder / "model.safetensors", metadata={"format": "pt"})


# (what is wrong with the checkpoint, the command, a fragment of the one error line)
CASES = [
    (_no_tokenizer, "generate", "has no tokenizer files"),
    (_no_tokenizer, "info", "has no tokenizer files"),
    (_no_spec, "generate", "its linearize entry has no spec"),
    (_no_spec, "info", "its linearize entry has no spec"),
    (_weights_changed, "generate", "does not match the sha256 recorded in config.json"),
]


@pytest.mark.parametrize("damage,command,fragment", CASES, ids=[f"{d.__name__}-{c}" for d, c, _ in CASES])
def test_checkpoint_errors_are_one_line(student_dir, damage, command, fragment):
    damage(student_dir)
    code, err = _run(command, str(student_dir), "--device", "cpu")
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("linearize: error:")]
    assert len(errors) == 1 and fragment in errors[0], err
