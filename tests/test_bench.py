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
                 "--new-tokens", "8", "32", "--prompt-len", "6", "--device", "cpu", "--out", str(tmp_path / "b.json")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())
    assert {r["model"] for r in rows} == {"teacher", "student"} and len(rows) == 8
    student = {(r["batch"], r["new_tokens"]): r["cache_bytes"] for r in rows if r["model"] == "student"}
    teacher = {(r["batch"], r["new_tokens"]): r["cache_bytes"] for r in rows if r["model"] == "teacher"}
    assert student[(2, 8)] == student[(2, 32)] and teacher[(2, 32)] > teacher[(2, 8)]
    assert all(r["decode_tok_s"] > 0 for r in rows)
    assert "| student |" in capsys.readouterr().out
