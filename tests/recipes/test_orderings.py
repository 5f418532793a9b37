"""``linearize orderings``: a paper's comparison table in one command, under the LM loss and from the
teacher side by side, at equal tokens per row; curves and a table; finished rows kept on a rerun."""

import json

import pytest

from linearize.cli import main


def _args(ws, out, *extra):
    return ["--teacher", str(ws / "teacher"), "--data", str(ws / "corpus.jsonl"), "--out", str(out), "--budget", "cpu",
            "--block-len", "32", "--batch-size", "4", "--eval-blocks", "4", "--steps", "10", "--eval-steps", "5",
            "--lr", "3e-3", "--dtype", "float32", "--device", "cpu", *extra]


def test_supra_table_three_under_both_losses(workspace, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    out = tmp_path / "t3"
    assert main(["orderings", "supra-table3", *_args(workspace, out), "--losses", "lm,kl+lm", "--align-steps", "2"]) == 0
    record = json.loads((out / "orderings.json").read_text())
    rows = {(r["loss"], r["row"]): r for r in record["rows"]}
    assert set(rows) == {(loss, row) for loss in ("lm", "kl+lm") for row in ("supra", "t2r", "supra-2step")}
    lm_tokens = {r["tokens"] for (loss, _), r in rows.items() if loss == "lm"}
    assert lm_tokens == {10 * 4 * 32}  # the 2-step row spends the same tokens (1 + 9 steps)
    assert all(r["val_next_token"] is not None and r["ppl"] > 0 for r in rows.values())
    t2r = json.loads((out / "lm" / "t2r" / "results.json").read_text())["config"]["spec"]
    assert t2r["norm"] == "sum" and t2r["decay"] == "none"
    kd = json.loads((out / "kl_plus_lm" / "supra" / "results.json").read_text())
    assert kd["align"]["steps"] == 2 and "align" not in json.loads((out / "lm" / "supra" / "results.json").read_text())
    assert (out / "curves.png").stat().st_size > 0
    assert "| supra-2step | lm |" in (out / "orderings.md").read_text()
    assert "| t2r | kl+lm |" in capsys.readouterr().out
    # run again: every row is finished, nothing trains
    before = {p: p.stat().st_mtime for p in out.glob("*/*/results.json")}
    assert main(["orderings", "supra-table3", *_args(workspace, out), "--losses", "lm,kl+lm", "--align-steps", "2"]) == 0
    assert {p: p.stat().st_mtime for p in out.glob("*/*/results.json")} == before


@pytest.mark.slow
def test_xatl_table_three(workspace, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    out = tmp_path / "x3"
    assert main(["orderings", "xatl-table3", *_args(workspace, out), "--losses", "lm"]) == 0
    record = json.loads((out / "orderings.json").read_text())
    assert [r["row"] for r in record["rows"]] == ["frozen", "unfrozen", "lit"]
    config = json.loads((out / "lm" / "frozen" / "results.json").read_text())["config"]
    assert config["freeze"] == "frozen" and config["weight_decay"] == 0.1 and config["spec"]["kind"] == "retnet"


@pytest.mark.parametrize("argv, message", [
    (["orderings", "supra-table9"], "invalid choice"),
    (["orderings", "xatl-table2", "--losses", "kl+nope"], "unknown loss nope"),
    (["orderings", "xatl-table2", "--losses", ","], "name at least one loss"),
])
def test_bad_orderings_fail_before_the_teacher_loads(argv, message, tmp_path, capsys):
    code = None
    try:
        code = main([*argv, "--teacher", str(tmp_path / "absent"), "--out", str(tmp_path / "o")])
    except SystemExit as exc:  # argparse's own refusal of a bad choice
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
