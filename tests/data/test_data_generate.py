"""``linearize data generate``: text sampled from a teacher through the fast decoder, deterministic
for a seed, resumable (a stopped run goes on and ends as an unstopped one), a --data source."""

import os
import signal
import subprocess
import sys
import time

import pytest

from linearize import load_teacher
from linearize.cli import main
from linearize.data import generate, load_blocks, read_texts
from linearize.data.generate import Settings, generate_text
from linearize.errors import LinearizeError
from linearize.paths import read_json_lines


@pytest.fixture(autouse=True)
def linearize_home(tmp_path, monkeypatch):
    home = tmp_path / "linearize-home"
    monkeypatch.setenv("LINEARIZE_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def teacher(workspace):
    return load_teacher(str(workspace / "teacher"), device="cpu")


def _settings(workspace, **overrides):
    base = dict(teacher="tiny", seed=0, batch_size=3, max_new_tokens=12, prompt_tokens=6,
                prompts=str(workspace / "corpus.jsonl"))
    return Settings(**{**base, **overrides})


def _shards(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("part-*.jsonl"))}


def test_deterministic_for_a_seed(teacher, workspace, tmp_path):
    model, tok = teacher
    a = generate_text(model, tok, tmp_path / "a", 60, _settings(workspace), progress=False)
    b = generate_text(model, tok, tmp_path / "b", 60, _settings(workspace), progress=False)
    assert a["new_tokens"] >= 60 and a["shards"] >= 2 and a["documents"] == 3 * a["shards"]
    assert _shards(tmp_path / "a") == _shards(tmp_path / "b")
    other = generate_text(model, tok, tmp_path / "c", 60, _settings(workspace, seed=1), progress=False)
    assert other["shards"] and _shards(tmp_path / "c") != _shards(tmp_path / "a")
    # the text is the prompt and its continuation, in the teacher's words
    text = read_texts(tmp_path / "a")
    assert len(text) == a["documents"] and all(t.split()[0].startswith("w") for t in text)


def test_a_stopped_run_goes_on_and_ends_as_an_unstopped_one(teacher, workspace, tmp_path, monkeypatch):
    model, tok = teacher
    whole = generate_text(model, tok, tmp_path / "whole", 90, _settings(workspace), progress=False)
    assert whole["shards"] >= 3

    write, calls = generate._write_shard, []

    def stop_after_two(path, records):
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill between two shards
        calls.append(path)
        write(path, records)

    monkeypatch.setattr(generate, "_write_shard", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        generate_text(model, tok, tmp_path / "stopped", 90, _settings(workspace), progress=False)
    assert len(_shards(tmp_path / "stopped")) == 2
    assert not [p for p in (tmp_path / "stopped").iterdir() if p.suffix == ".tmp"]
    monkeypatch.undo()
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "linearize-home"))
    resumed = generate_text(model, tok, tmp_path / "stopped", 90, _settings(workspace), progress=False)
    assert resumed == {**whole, "out": str(tmp_path / "stopped")}
    assert _shards(tmp_path / "stopped") == _shards(tmp_path / "whole")


def test_more_tokens_add_shards(teacher, workspace, tmp_path):
    model, tok = teacher
    generate_text(model, tok, tmp_path / "grown", 30, _settings(workspace), progress=False)
    generate_text(model, tok, tmp_path / "grown", 80, _settings(workspace), progress=False)
    generate_text(model, tok, tmp_path / "direct", 80, _settings(workspace), progress=False)
    assert _shards(tmp_path / "grown") == _shards(tmp_path / "direct")


def test_a_shard_with_unicode_line_separators_reads_back(tmp_path):
    """Sampled text may hold U+2028, U+2029 or U+0085, which JSON leaves raw and str.splitlines()
    treats as line ends: a 10M-token run on the GPU wrote such shards and then could not read them."""
    records = [{"text": "a\u2028b\u2029c\x85d\x0be", "new_tokens": 4}, {"text": "plain", "new_tokens": 1}]
    generate._write_shard(tmp_path / "part-000000.jsonl", records)
    assert read_json_lines(tmp_path / "part-000000.jsonl") == records
    assert generate.done_so_far(tmp_path) == (1, 5)
    assert read_texts(str(tmp_path / "part-000000.jsonl")) == [r["text"] for r in records]


def test_other_settings_or_a_foreign_folder_are_refused(teacher, workspace, tmp_path):
    model, tok = teacher
    generate_text(model, tok, tmp_path / "g", 10, _settings(workspace), progress=False)
    with pytest.raises(LinearizeError, match="other settings.*batch_size=3"):
        generate_text(model, tok, tmp_path / "g", 10, _settings(workspace, batch_size=4), progress=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(LinearizeError, match="not written by this command"):
        generate_text(model, tok, tmp_path / "mine", 10, _settings(workspace), progress=False)
    for bad in (dict(batch_size=0), dict(temperature=0.0), dict(top_p=1.5), dict(max_new_tokens=-1)):
        with pytest.raises(LinearizeError):
            generate_text(model, tok, tmp_path / "x", 10, _settings(workspace, **bad), progress=False)


def test_the_command_makes_a_data_source(workspace, tmp_path, capsys):
    teacher_dir, corpus = str(workspace / "teacher"), str(workspace / "corpus.jsonl")
    args = ["data", "generate", "--teacher", teacher_dir, "--tokens", "30", "--batch-size", "2",
            "--max-new-tokens", "10", "--prompt-tokens", "5", "--prompts", corpus, "--device", "cpu", "--quiet"]
    assert main([*args, "--name", "tiny"]) == 0
    assert "--data generated:tiny" in capsys.readouterr().out
    _, tok = load_teacher(teacher_dir, device="cpu")
    train = load_blocks("generated:tiny", tok, block_len=8)
    mixed = load_blocks(f"generated:tiny=1,{corpus}=1", tok, block_len=8)
    assert train.shape[1] == 8 and mixed.shape[0] > train.shape[0]
    # checked before the teacher loads: a bad number, a missing name, a file as --out
    assert main(["data", "generate", "--teacher", str(tmp_path / "no-teacher"), "--tokens", "0"]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert main(["data", "--data", "generated:nothing-here", "--tokenizer", teacher_dir]) == 2
    assert "no generated text named 'nothing-here'" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main([*args, "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err


@pytest.mark.slow
def test_killed_with_sigkill_then_run_again(teacher, workspace, tmp_path):
    """A real kill -9 of the command while it writes shards; the second run finishes the text, which
    equals an uninterrupted run's (here made in this process with the command's settings)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LINEARIZE_HOME": str(tmp_path / "linearize-home")}
    args = [sys.executable, "-m", "linearize", "data", "generate", "--teacher", str(workspace / "teacher"),
            "--tokens", "100", "--batch-size", "2", "--max-new-tokens", "10", "--prompt-tokens", "5",
            "--prompts", str(workspace / "corpus.jsonl"), "--device", "cpu", "--quiet", "--out", str(tmp_path / "killed")]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while len(list((tmp_path / "killed").glob("part-*.jsonl"))) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    model, tok = teacher
    settings = _settings(workspace, teacher=str((workspace / "teacher").resolve()), batch_size=2, max_new_tokens=10,
                         prompt_tokens=5)
    whole = generate_text(model, tok, tmp_path / "whole", 100, settings, progress=False)
    assert 0 < len(_shards(tmp_path / "killed")) < whole["shards"]
    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert _shards(tmp_path / "killed") == _shards(tmp_path / "whole")
