"""`python -m linearize.orderings`: a paper table's rows under each loss, run through the recipes'
command line, drawn and tabulated."""

import json

import pytest

from linearize import orderings


def _tiny(ws):
    return ["--teacher", str(ws / "teacher"), "--data", str(ws / "corpus.jsonl"), "--budget", "cpu",
            "--block-len", "32", "--batch-size", "4", "--eval-blocks", "4", "--steps", "6", "--eval-steps", "3",
            "--lr", "3e-3", "--dtype", "float32", "--device", "cpu"]


def test_dry_run_prints_every_row_under_every_loss(capsys, tmp_path):
    assert orderings.main(["xatl-table2", "--dry-run", "--out", str(tmp_path), "--steps", "40"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 * len(orderings.TABLES["xatl-t2"].rows)
    assert all(line.startswith("linearize xatl --out ") and "--steps 40" in line for line in lines)
    assert sum("--loss next_token" in line for line in lines) == sum("--loss kl " in line for line in lines) == 6
    assert any("--transfer embeddings,ffn,attention --keep-softmax xatl" in line for line in lines)
    assert any("--transfer embeddings,ffn,qkv" in line for line in lines)
    assert not any(tmp_path.iterdir())  # nothing run, nothing written


def test_two_step_takes_a_share_of_the_steps():
    runs = orderings.plan("supra-t3", "o", losses=["lm"], rows=["supra-2-step"], extra=["--steps", "100"])
    assert runs[0].argv[-4:] == ["--new-weights-first", "25", "--steps", "75"]  # equal tokens: 25 + 75
    runs = orderings.plan("supra-t3", "o", losses=["lm"], rows=["SUPRA 2-step"], budget="cpu")
    total = orderings.planned_steps("supra", "cpu", None, [])
    assert runs[0].argv[-3] == str(int(total * 0.25)) and int(runs[0].argv[-3]) + int(runs[0].argv[-1]) == total


@pytest.mark.parametrize("argv,match", [(["xatl-t9"], "unknown table"), (["supra-t3", "--losses", "mse"], "unknown loss"),
                                        (["xatl-t3", "--rows", "thawed"], "has no row thawed")])
def test_bad_choices_one_line(argv, match, capsys):
    assert orderings.main([*argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linearize: error: ") and match in err and err.count("\n") == 1


@pytest.mark.slow
def test_supra_table_end_to_end(workspace, monkeypatch, tmp_path, capsys):
    """SUPRA Table 3 at tiny settings: 3 rows x (lm, kl), curves, table; a second call runs nothing."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    out = tmp_path / "orderings"
    assert orderings.main(["supra-table3", "--out", str(out), "--in-process", *_tiny(workspace)]) == 0
    folder = out / "supra-t3"
    data = json.loads((folder / "orderings.json").read_text())
    assert [(r["loss"], r["row"]) for r in data["runs"]] == [
        (loss, row) for loss in ("lm", "kl") for row in ("SUPRA", "T2R", "SUPRA 2-step")]
    for r in data["runs"]:
        assert r["finished"] and len(r["curve"]) >= 2 and r["metric"] == "next-token", r
        assert r["curve"][-1][0] == 6 * 4 * 32 == r["tokens"]  # steps x batch x block (2-step: 1 + 5 steps)
        assert r["ppl"] > 1
    kl_config = (folder / "kl" / "supra" / "run_config.yaml").read_text()
    assert "loss: kl" in kl_config
    text = (folder / "README.md").read_text()
    assert "| T2R |" in text and "lm: final validation loss, lowest first" in text
    assert (folder / "curves.png").stat().st_size > 1000
    capsys.readouterr()
    assert orderings.main(["supra-table3", "--out", str(out), "--in-process", *_tiny(workspace)]) == 0
    assert capsys.readouterr().out.count("done already") == 6
