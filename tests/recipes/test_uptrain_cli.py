"""`linearize supra` and `linearize xatl` end to end on the tiny teacher."""

import json

import pytest

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
    """The T2R variant; and --cuda-graph auto (the default) on the CPU trains eagerly, says why in one
    line and records it in results.json."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the CPU's run, also on a GPU machine
    assert main(["supra", *_common(workspace, tmp_path / "s"), "--variant", "t2r"]) == 0
    config = json.loads((tmp_path / "s" / "final" / "config.json").read_text())
    assert config["linearize"]["spec"]["norm"] == "sum" and config["linearize"]["spec"]["decay"] == "none"
    results = json.loads((tmp_path / "s" / "results.json").read_text())
    assert results["config"]["cuda_graph"] == "auto"
    assert results["cuda_graph"] == {"setting": "auto", "graphed": False, "why": "there is no CUDA device"}
    notes = [line for line in capsys.readouterr().err.splitlines() if "CUDA graphs" in line]
    assert notes == ["linearize: training eagerly, not as CUDA graphs (--cuda-graph auto): there is no CUDA device"]


def test_uptraining_reports_set_up_and_steady_state(workspace, monkeypatch, tmp_path, capsys):
    """results.json's train record and the printed summary split the time of both stages (alignment,
    then training) into set-up (each stage's first 2 steps and what came before them) and steady state
    (the later steps); the rest is evaluations, checkpoints and what ran between the stages."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    assert main(["supra", *_common(workspace, tmp_path / "s"), "--steps", "5", "--align-steps", "3",
                 "--eval-steps", "2"]) == 0
    results = json.loads((tmp_path / "s" / "results.json").read_text())
    train = results["train"]
    assert (train["setup"]["steps"], train["steady"]["steps"]) == (4, 1 + 3)
    assert train["steady"]["tokens"] == 4 * 4 * 32 and train["steady"]["tokens_per_second"] > 0
    parts = train["setup"]["seconds"] + train["steady"]["seconds"] + train["other_seconds"]
    assert parts == pytest.approx(train["seconds"])
    assert "speed" not in results["align"]  # counted in train's split
    out = capsys.readouterr().out.splitlines()
    line = next(x for x in out if x.strip().startswith("trained"))
    assert "; set-up " in line and "(4 steps), steady " in line and "tok/s over 4 steps)" in line
    phases = results["phases"]  # the run's wall time by phase, the stages together as "training"
    assert list(phases)[:4] == ["teacher", "data", "perplexity: teacher", "build"]
    assert phases["training"] == pytest.approx(train["seconds"]) and {"save", "sample"} <= set(phases)
    assert any(x.strip().startswith("wall time ") for x in out)


def test_xatl_from_scratch_through_the_cli(workspace, monkeypatch, tmp_path, capsys):
    """--transfer scratch (as --help offers it) builds the architecture with nothing copied; --cuda-graph
    off trains eagerly without a note, as results.json records."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    assert main(["xatl", *_common(workspace, tmp_path / "x"), "--arch", "retnet", "--transfer", "scratch",
                 "--steps", "2", "--eval-steps", "2", "--cuda-graph", "off"]) == 0
    res = json.loads((tmp_path / "x" / "results.json").read_text())
    assert "nothing (scratch)" in res["transfer_report"]
    assert res["cuda_graph"] == {"setting": "off", "graphed": False}
    assert json.loads((tmp_path / "x" / "train" / "train_config.json").read_text())["cuda_graph"] is False
    assert "CUDA graphs" not in capsys.readouterr().err


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
    flags = [training_arguments(uptrain.train_config(cfg, tmp_path / "o", 1, 0), has_eval=False).torch_compile
             for cfg in seen]
    assert flags == [True, True, False]


def test_cuda_graph_setting_reaches_the_trainer(monkeypatch, tmp_path, capsys):
    """`--cuda-graph` on supra/xatl is `on`, `--cuda-graph off|auto` the others, unset is auto; a recipe
    file's true/false (and YAML's on/off) are on/off, flags win; each reaches TrainConfig.cuda_graph
    through the run's decision (here on a CUDA device said to be there)."""
    import torch

    from linearize.recipes import uptrain

    seen = []
    monkeypatch.setattr(uptrain, "run", lambda cfg: seen.append(cfg) or {})
    monkeypatch.setattr(uptrain, "summary", lambda results, method: "")
    files = {}
    for name, text in (("true", "cuda_graph: true"), ("false", "cuda_graph: false"), ("on", "cuda_graph: on"),
                       ("off", "cuda_graph: off"), ("auto", "cuda_graph: auto")):
        files[name] = tmp_path / f"{name}.yaml"
        files[name].write_text(text + "\n")
    commands = (["supra", "--cuda-graph"], ["xatl", "--arch", "retnet", "--cuda-graph"], ["supra"],
                ["supra", "--cuda-graph", "off"], ["xatl", "--cuda-graph", "auto"],
                *(["supra", "--config", str(files[n])] for n in ("true", "false", "on", "off", "auto")),
                ["supra", "--config", str(files["true"]), "--cuda-graph", "off"])
    for cmd in commands:
        assert main([*cmd, "--out", str(tmp_path / "o"), "--budget", "cpu"]) == 0
    settings = ["on", "on", "auto", "off", "auto", "on", "off", "on", "off", "auto", "off"]
    assert [cfg.cuda_graph for cfg in seen] == settings
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [uptrain.train_config(cfg, tmp_path / "o", 1, 0).cuda_graph for cfg in seen] == [s != "off" for s in settings]
    (tmp_path / "bad.yaml").write_text("cuda_graph: sometimes\n")
    assert main(["supra", "--config", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == ("linearize: error: cuda_graph must be auto, on or off (or true/false), "
                                               "got 'sometimes'")


def test_cuda_graph_on_without_cuda_stops_in_one_line(monkeypatch, tmp_path, capsys):
    """`--cuda-graph` (on) on a machine without CUDA stops with one line before loading anything."""
    import torch

    import linearize

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    monkeypatch.setattr(linearize, "load_teacher", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    for cmd in (["supra", "--cuda-graph"], ["xatl", "--cuda-graph", "on"]):
        assert main([*cmd, "--out", str(tmp_path / "o"), "--budget", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.strip() == ("linearize: error: --cuda-graph on: there is no CUDA device; --cuda-graph auto or off "
                               "trains eagerly")


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
