"""`linearize bench` measures both models and the student's cache does not grow with length."""

import json

from helpers import tiny_tokenizer
from linearize import convert, save
from linearize.cli import main


def test_bench_cli_on_tiny_models(tiny_model, tmp_path, capsys):
    teacher = tiny_model("llama")
    save(teacher, tiny_tokenizer(), tmp_path / "teacher")
    save(convert(teacher, "lolcats", window=4, feature_dim=8), tiny_tokenizer(), tmp_path / "student")
    assert main(["bench", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"), "--batch-sizes", "1", "2",
                 "--new-tokens", "8", "32", "--prompt-len", "6", "--device", "cpu", "--out", str(tmp_path / "b.json"),
                 "--teacher-paths", "generate", "static", "fast", "--paths", "fast", "generate", "--plots", str(tmp_path / "plots")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())
    pairs = {(r["model"], r["path"]) for r in rows}
    assert pairs == {("teacher", "generate"), ("teacher", "static"), ("teacher", "fast"),
                     ("student", "fast"), ("student", "generate")} and len(rows) == 20
    held = {(r["model"], r["path"], r["batch"], r["new_tokens"]): r["cache_bytes"] for r in rows}
    for path in ("fast", "generate"):
        assert held[("student", path, 2, 8)] == held[("student", path, 2, 32)] > 0
    assert held[("teacher", "generate", 2, 32)] > held[("teacher", "generate", 2, 8)]
    assert held[("teacher", "fast", 2, 32)] > held[("teacher", "fast", 2, 8)]
    assert all(r["decode_tok_s"] > 0 for r in rows)
    text = capsys.readouterr().out
    assert "| student | fast |" in text and "| teacher | static |" in text
    assert (tmp_path / "plots" / "tok_s_vs_batch.png").stat().st_size > 0
    assert (tmp_path / "plots" / "memory_vs_length.png").stat().st_size > 0
