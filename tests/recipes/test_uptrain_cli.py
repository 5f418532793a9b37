"""`linearize supra` and `linearize xatl` end to end on the tiny teacher."""

import json

from linearize.cli import main


def _common(ws, out):
    return ["--teacher", str(ws / "teacher"), "--data", str(ws / "corpus.jsonl"), "--out", str(out), "--budget", "cpu",
            "--block-len", "32", "--batch-size", "4", "--eval-blocks", "8", "--steps", "12", "--eval-steps", "4",
            "--lr", "3e-3", "--dtype", "float32", "--device", "cpu"]


def test_xatl_with_lit(workspace, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    assert main(["xatl", *_common(workspace, tmp_path / "x"), "--arch", "retnet", "--transfer", "embeddings,ffn",
                 "--hybrid", "xatl", "--freeze", "lit", "--lit-threshold", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "[xatl]" in text and "after training" in text
    res = json.loads((tmp_path / "x" / "results.json").read_text())
    assert "embeddings" in res["transfer_report"]
    config = json.loads((tmp_path / "x" / "final" / "config.json").read_text())
    assert config["linearize"]["spec"]["kind"] == "retnet" and config["linearize"]["keep_softmax"] == [1, 2]  # layers N//2 and 2 of 3


def test_supra_t2r_variant(workspace, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    assert main(["supra", *_common(workspace, tmp_path / "s"), "--variant", "t2r"]) == 0
    config = json.loads((tmp_path / "s" / "final" / "config.json").read_text())
    assert config["linearize"]["spec"]["norm"] == "sum" and config["linearize"]["spec"]["decay"] == "none"


def test_xatl_from_scratch_through_the_cli(workspace, monkeypatch, tmp_path):
    """--transfer scratch (as --help offers it) builds the architecture with nothing copied."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    assert main(["xatl", *_common(workspace, tmp_path / "x"), "--arch", "retnet", "--transfer", "scratch",
                 "--steps", "2", "--eval-steps", "2"]) == 0
    res = json.loads((tmp_path / "x" / "results.json").read_text())
    assert "nothing (scratch)" in res["transfer_report"]


def test_xatl_bad_transfer_fails_before_loading_the_teacher(workspace, monkeypatch, tmp_path, capsys):
    import linearize

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded before the transfer map was checked")

    monkeypatch.setattr(linearize, "load_teacher", no_teacher)
    assert main(["xatl", *_common(workspace, tmp_path / "x"), "--arch", "retnet", "--transfer", "embedings"]) != 0
    assert "unknown transfer item(s) embedings" in capsys.readouterr().err


def test_compile_flag_reaches_the_trainer(monkeypatch, tmp_path):
    """`--compile` on supra/xatl sets TrainingArguments.torch_compile (off unless asked)."""
    from linearize.recipes import uptrain
    from linearize.recipes.engine import training_arguments

    seen = []
    monkeypatch.setattr(uptrain, "run", lambda cfg: seen.append(cfg) or {})
    monkeypatch.setattr(uptrain, "summary", lambda results, method: "")
    for cmd in (["supra", "--compile"], ["xatl", "--arch", "retnet", "--compile"], ["supra"]):
        assert main([*cmd, "--out", str(tmp_path / "o"), "--budget", "cpu"]) == 0
    assert [cfg.compile for cfg in seen] == [True, True, False]
    flags = [training_arguments(cfg.train_config(tmp_path / "o", 1, 0), has_eval=False).torch_compile for cfg in seen]
    assert flags == [True, True, False]


def test_cuda_graph_flag_reaches_the_trainer_and_needs_cuda(monkeypatch, tmp_path, capsys):
    """`--cuda-graph` on supra/xatl sets TrainConfig.cuda_graph; without CUDA the run stops with one
    line before loading anything."""
    import torch

    import linearize
    from linearize.recipes import uptrain

    seen = []
    real_run = uptrain.run
    monkeypatch.setattr(uptrain, "run", lambda cfg: seen.append(cfg) or {})
    monkeypatch.setattr(uptrain, "summary", lambda results, method: "")
    for cmd in (["supra", "--cuda-graph"], ["xatl", "--arch", "retnet", "--cuda-graph"], ["supra"]):
        assert main([*cmd, "--out", str(tmp_path / "o"), "--budget", "cpu"]) == 0
    assert [cfg.train_config(tmp_path / "o", 1, 0).cuda_graph for cfg in seen] == [True, True, False]
    if torch.cuda.is_available():
        return
    monkeypatch.setattr(uptrain, "run", real_run)
    monkeypatch.setattr(linearize, "load_teacher", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert main(["supra", "--cuda-graph", "--out", str(tmp_path / "o"), "--budget", "cpu"]) != 0
    err = capsys.readouterr().err
    assert "--cuda-graph needs a CUDA device" in err and len(err.strip().splitlines()) == 1


def test_xatl_names_its_softmax_layers_keep_softmax(monkeypatch, tmp_path, capsys):
    """XATL's kept softmax layers go by the name every recipe uses (--keep-softmax; --hybrid is the same
    flag), a run config saved under the earlier name still runs, and only XATL takes 'xatl'."""
    from linearize.recipes import uptrain

    seen = []
    monkeypatch.setattr(uptrain, "run", lambda cfg: seen.append(cfg) or {})
    monkeypatch.setattr(uptrain, "summary", lambda results, method: "")
    old = tmp_path / "run_config.json"
    old.write_text(json.dumps({"method": "xatl", "arch": "retnet", "keep_softmax": [], "hybrid": "xatl"}))
    for extra in (["--keep-softmax", "xatl"], ["--hybrid", "2,15"], ["--config", str(old)], []):
        assert main(["xatl", *extra, "--out", str(tmp_path / "o"), "--budget", "cpu"]) == 0
    assert [cfg.keep_softmax for cfg in seen] == ["xatl", (2, 15), "xatl", ()]
    assert all(not hasattr(cfg, "hybrid") for cfg in seen)
    for cmd in (["supra"], ["lolcats"]):
        assert main([*cmd, "--keep-softmax", "xatl", "--out", str(tmp_path / "o"), "--budget", "cpu"]) == 2
        assert "xatl" in capsys.readouterr().err
