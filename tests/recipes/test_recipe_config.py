"""Recipes from configuration files: ``linearize <recipe> --config FILE`` sets any setting of the recipe
(YAML, a run's own run_config.json, or a packaged recipe's name), flags win, unknown keys fail with one
line before anything loads, and the run_config.json a run saves runs it again to the same figures."""

import json
from dataclasses import fields

import pytest
import yaml

from linearize.cli import SPEC_FLAGS, main
from linearize.recipes import lolcats
from linearize.recipes.supra import SupraConfig
from linearize.recipes.xatl import XatlConfig
from linearize.recipes.configs import names, packaged


def _tiny(ws, out) -> dict:
    return {"teacher": str(ws / "teacher"), "data": str(ws / "corpus.jsonl"), "out": str(out), "budget": "cpu",
            "block_len": 32, "batch_size": 4, "eval_blocks": 4, "eval_steps": 2, "dtype": "float32",
            "feature_dim": 8, "window": 4, "stage1_steps": 4, "stage2_steps": 4}


def test_lolcats_from_yaml_alone_then_again_from_its_run_config(workspace, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_tiny(workspace, tmp_path / "a")))
    assert main(["lolcats", "--config", str(recipe), "--device", "cpu"]) == 0
    first = json.loads((tmp_path / "a" / "results.json").read_text())
    assert first["stage1"]["steps"] == 4 and first["config"]["block_len"] == 32
    assert first["config"]["spec"]["window"] == 4 and first["config"]["spec"]["feature_dim"] == 8
    # the saved configuration runs the same run again (to another folder)
    assert main(["lolcats", "--config", str(tmp_path / "a" / "run_config.json"), "--out", str(tmp_path / "b")]) == 0
    second = json.loads((tmp_path / "b" / "results.json").read_text())
    assert second["perplexity"] == pytest.approx(first["perplexity"], rel=1e-6)
    assert {k: v for k, v in second["config"].items() if k != "out"} == \
        {k: v for k, v in first["config"].items() if k != "out"}


def test_flags_win_over_the_file(workspace, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    recipe = tmp_path / "recipe.yaml"
    settings = {k: v for k, v in _tiny(workspace, tmp_path / "a").items() if not k.startswith("stage")}
    recipe.write_text(yaml.safe_dump({**settings, "steps": 6, "kind": "supra"}))
    assert main(["supra", "--config", str(recipe), "--steps", "2", "--feature-dim", "4", "--device", "cpu"]) == 0
    config = json.loads((tmp_path / "a" / "results.json").read_text())["config"]
    assert config["steps"] == 2 and config["spec"]["feature_dim"] == 4 and config["block_len"] == 32
    assert config["method"] == "supra" and config["spec"]["kind"] == "supra"


@pytest.mark.parametrize("content, message", [
    ({"stage1_stepz": 3}, "no setting stage1_stepz in the lolcats recipe"),
    ({"budget": "huge"}, "budget must be cpu, gpu or paper"),
    ({"method": "xatl"}, "is a xatl recipe; run it with 'linearize xatl'"),
    ("- a list", "must hold a mapping of settings"),
    ({"keep_softmax": "auto:2", "auto_softmax_score": "entropy"}, "auto_softmax_score must be one of mse, recall"),
    ({"auto_softmax_score": "recall"}, "chooses the layers of keep_softmax auto:K, which this run does not ask for"),
])
def test_bad_recipe_files_fail_in_one_line_before_loading(content, message, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(content) if isinstance(content, dict) else content)
    assert main(["lolcats", "--config", str(recipe), "--teacher", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linearize: error: ") and message in err and err.count("\n") == 1, err


def test_a_budget_flag_overrides_the_files_budget(workspace, monkeypatch, tmp_path):
    """A packaged recipe names its budget; --budget on the command line wins instead of failing."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**_tiny(workspace, tmp_path / "a"), "budget": "gpu", "stage2_steps": 1,
                                      "stages": ["stage2"]}))
    assert main(["lolcats", "--config", str(recipe), "--budget", "cpu", "--device", "cpu"]) == 0
    result = json.loads((tmp_path / "a" / "results.json").read_text())
    assert result["config"]["block_len"] == 32 and result["stage2"]["steps"] == 1


def test_a_missing_recipe_names_the_packaged_ones(tmp_path, capsys):
    assert main(["xatl", "--config", "no_such_recipe", "--teacher", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "no such recipe file: no_such_recipe" in err and "xatl_hybrid" in err


@pytest.mark.parametrize("name", names())
def test_packaged_recipes_name_only_real_settings(name):
    recipe = yaml.safe_load(packaged(name).read_text())
    config = {"lolcats": lolcats.LolcatsConfig, "supra": SupraConfig, "xatl": XatlConfig}[name.split("_")[0]]
    known = {f.name for f in fields(config)} | set(SPEC_FLAGS) | {"budget"}
    assert set(recipe) <= known, set(recipe) - known
    assert packaged(f"{name}.yaml") == packaged(name)


def test_a_sample_that_fails_to_decode_loses_no_results(workspace, monkeypatch, tmp_path):
    """The recipe's last act decodes a sample; when that fails, the checkpoint and results.json are
    already written."""
    import linearize.fast

    def broken(*args, **kwargs):
        raise RuntimeError("decoding broke")

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(linearize.fast, "fast_generate", broken)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_tiny(workspace, tmp_path / "a")))
    with pytest.raises(RuntimeError, match="decoding broke"):
        main(["lolcats", "--config", str(recipe), "--device", "cpu"])
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert results["stage2"]["steps"] == 4 and "sample" not in results
    assert (tmp_path / "a" / "final" / "config.json").exists()


def _resolved(argv: list[str]) -> lolcats.LolcatsConfig:
    """The config ``linearize lolcats ARGV`` would run (nothing loads)."""
    from linearize.cli import _recipe_config, build_parser

    args = build_parser().parse_args(["lolcats", *argv])
    return _recipe_config(args, lolcats.LolcatsConfig, lolcats.apply_budget, "runs/lolcats", lolcats.DEFAULT_SPEC)


def _trained(cfg) -> dict:
    """What a run trains: its settings but where it writes."""
    from dataclasses import asdict

    return {k: v for k, v in asdict(cfg).items() if k != "out"}


def test_the_default_lolcats_run_is_the_window_recipe_and_the_earlier_ones_stay_named(capsys):
    """``linearize lolcats`` with no flags on a GPU trains what ``--config lolcats_tiers`` names (the measured
    best across domains: the hybrid with features before RoPE, gates and kept sliding layers, 8,192-token blocks of
    books + code + WordNet, and after stage 1 the layers that most help copying kept as the teacher's softmax over
    1,280 tokens, four over 4,288, with 4 sinks and float8 keys and values); ``--config lolcats_wide`` is the default
    before it, ``lolcats_mix`` the one before, ``lolcats_plain`` the paper's student; the cpu budget trains the hybrid
    alone on short blocks of the books; flags still win over the default file."""
    hybrid = {"kind": "lolcats", "feature_map": "hedgehog", "feature_dim": 64, "window": 64, "feature_rope": False,
              "decay": "gated", "keep_sliding": True}
    default = _resolved(["--budget", "gpu"])
    assert "no --config on the gpu budget: the default recipe, lolcats_tiers" in capsys.readouterr().out  # one line
    assert default.spec == {**hybrid, "softmax_window": 1280, "softmax_window_sinks": 4, "softmax_window_dtype": "float8"}
    assert (default.keep_softmax, default.auto_softmax_score, default.auto_softmax_distance) == ("auto:0.47", "recall",
                                                                                                 1024)
    assert default.auto_softmax_long == "4@4288"
    assert (default.block_len, default.batch_size, default.stage1_steps, default.stage2_steps) == (8192, 1, 1220, 1220)
    assert default.data == "gutenberg,corpus:code,corpus:wordnet"
    assert _trained(_resolved(["--config", "lolcats_tiers"])) == _trained(default)
    capsys.readouterr()
    wide = _resolved(["--config", "lolcats_wide"])
    assert wide.spec == {**hybrid, "softmax_window": 1280} and (wide.block_len, wide.batch_size) == (4096, 2)
    assert wide.keep_softmax == "auto:0.47" and wide.auto_softmax_long in (None, "")
    capsys.readouterr()
    mix = _resolved(["--config", "lolcats_mix"])
    assert capsys.readouterr().out == ""
    assert mix.spec == hybrid and mix.keep_softmax == () and (mix.block_len, mix.data) == (4096, default.data)
    assert _resolved(["--budget", "gpu", "--keep-softmax", "3,5"]).keep_softmax == (3, 5)  # named layers win
    assert _resolved(["--budget", "gpu", "--data", "gutenberg"]).data == "gutenberg"
    plain = _resolved(["--config", "lolcats_plain"])
    assert plain.spec == {**hybrid, "feature_rope": True, "decay": "none", "keep_sliding": False}
    assert (plain.block_len, plain.batch_size, plain.stage1_steps, plain.data) == (1024, 8, 2440, "gutenberg")
    assert _resolved(["--config", "lolcats_paper"]).spec == plain.spec  # the paper's student, 2 epochs per stage
    long = _resolved(["--config", "lolcats_long"])
    assert long.spec == hybrid and long.data == "gutenberg" and long.block_len == 4096
    cpu = _resolved(["--budget", "cpu"])
    assert cpu.spec == hybrid and cpu.keep_softmax == () and cpu.block_len == 256 and cpu.data is None  # books


def test_the_demo_trains_what_the_command_trains(tmp_path):
    """``make demo`` runs the recipe ``linearize lolcats`` runs with no flags: the hybrid on short blocks of the
    books on the cpu budget, the default recipe file on the gpu budget."""
    from linearize.demo import recipe_config

    for budget in ("cpu", "gpu"):
        got = recipe_config(tmp_path / "demo", budget)
        assert got.out == str(tmp_path / "demo")
        assert _trained(got) == _trained(_resolved(["--budget", budget]))
    assert recipe_config(tmp_path, "gpu").keep_softmax == "auto:0.47"


def test_the_no_window_row_of_the_default_is_a_valid_linear_student():
    """LoLCATs Table 5's no-window row drops the hybrid's own options (a linear student takes neither
    features before RoPE nor per-key-head gates)."""
    from linearize.spec import Spec

    row = lolcats.ablation_config(_resolved(["--budget", "gpu"]), "no-window")
    spec = Spec(**row.spec)
    assert spec.kind == "linear" and spec.feature_rope and spec.decay in (None, "none")
