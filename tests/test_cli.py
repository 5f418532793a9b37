"""The command line: each command on a tiny local teacher, and bad input -> one line, non-zero exit."""

import os
import subprocess
import sys

import pytest
import torch

from linearize.cli import main
from linearize.recipes.configs import names, packaged

from helpers import tiny_config, tiny_tokenizer


@pytest.fixture
def teacher_dir(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    model.save_pretrained(tmp_path / "teacher")
    tiny_tokenizer().save_pretrained(tmp_path / "teacher")
    return tmp_path / "teacher"


def test_convert_info_generate(teacher_dir, tmp_path, capsys):
    out = tmp_path / "student"
    assert main(["convert", "--teacher", str(teacher_dir), "--out", str(out), "--kind", "supra",
                 "--keep-softmax", "1", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "supra [0], softmax [1], supra [2]" in text and f"saved {out}" in text
    assert main(["info", str(out)]) == 0
    assert "bytes per token (softmax layers)" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "w5 w6 w7", "--max-new-tokens", "5", "--device", "cpu"]) == 0
    assert main(["generate", str(out), "--prompt", "w5 w6 w7", "--max-new-tokens", "5", "--device", "cpu",
                 "--temperature", "0.8", "--top-p", "0.9"]) == 0
    capsys.readouterr()
    texts = {}
    for decoder in ("fast", "generate"):
        assert main(["generate", str(out), "--prompt", "w5 w6 w7", "--max-new-tokens", "6", "--device", "cpu",
                     "--decoder", decoder]) == 0
        texts[decoder] = capsys.readouterr().out
    assert texts["fast"] == texts["generate"] and texts["fast"].strip()


def test_generate_takes_a_prompt_file_and_a_sparse_cache(teacher_dir, tmp_path, capsys, monkeypatch):
    """``generate --prompt-file F --sparse-cache S --sparse-linear W``: the checkpoint gets the cache for the
    call (the fast decoder and generate() agree under it, also on a prompt holding the pad id); a rule
    without a cache, a cache for a teacher and an unreadable prompt file are refused in one line."""
    import importlib

    convert = importlib.import_module("linearize.convert")  # the package (linearize.convert is the function)
    out = tmp_path / "student"
    assert main(["convert", "--teacher", str(teacher_dir), "--out", str(out), "--kind", "lolcats", "--window", "4",
                 "--feature-dim", "8", "--device", "cpu"]) == 0
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(f"w{5 + i % 40}" for i in range(60)))  # w10 ... -> w1 w0: the pad id (0) inside
    seen, respec = [], convert.respec
    monkeypatch.setattr(convert, "respec", lambda model, **kw: seen.append(kw) or respec(model, **kw))
    capsys.readouterr()
    texts = {}
    for decoder in ("fast", "generate"):
        assert main(["generate", str(out), "--prompt-file", str(prompt), "--max-new-tokens", "6", "--device", "cpu",
                     "--sparse-cache", "8", "--sparse-linear", "0", "--decoder", decoder]) == 0
        texts[decoder] = capsys.readouterr().out
    assert texts["fast"] == texts["generate"] and texts["fast"].strip()
    assert seen[-1]["sparse_cache"] == 8 and seen[-1]["sparse_linear"] == 0.0
    for args, message in [(["--sparse-priority", "recall"], "--sparse-priority sets how the sparse cache works"),
                          (["--prompt-file", str(tmp_path / "absent.txt")], "cannot read the prompt file")]:
        assert main(["generate", str(out), "--device", "cpu", *args]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], errors
    assert main(["generate", str(teacher_dir), "--device", "cpu", "--sparse-cache", "8"]) == 2
    assert "not one" in capsys.readouterr().err


def test_convert_from_yaml_recipe_with_flag_override(teacher_dir, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"teacher: {teacher_dir}\nkind: lolcats\nwindow: 8\nfeature_map: t2r\n")
    out = tmp_path / "student"
    assert main(["convert", "--config", str(recipe), "--window", "16", "--out", str(out), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "'window': 16" in text and "'feature_map': 't2r'" in text


@pytest.mark.parametrize("name", names())
def test_convert_builds_the_student_a_packaged_recipe_describes(name, teacher_dir, tmp_path, capsys):
    """``convert --config NAME`` on every packaged recipe: the student its command starts from (the file's
    spec; XATL's architecture, transfer and kept layers), and one line naming the file's settings left to
    that command."""
    import json

    import yaml

    from linearize.cli import SPEC_FLAGS

    recipe = yaml.safe_load(packaged(name).read_text())
    out = tmp_path / "student"
    assert main(["convert", "--config", name, "--teacher", str(teacher_dir), "--out", str(out), "--device", "cpu"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "leaves" in line]
    record = json.loads((out / "config.json").read_text())["linearize"]
    method = name.split("_")[0]
    if method == "xatl":  # the 3-layer teacher's layers 2 and N // 2 = 1 keep softmax
        used = {"arch", "transfer", "keep_softmax"}
        assert record["spec"]["kind"] == recipe["arch"] and record["keep_softmax"] == [1, 2]
        assert record["xatl"]["transfer"] == recipe["transfer"].split(",")
    else:  # keep_softmax auto:K is chosen after stage 1: left to the recipe, the student converts every layer
        used = set(SPEC_FLAGS) - ({"keep_softmax"} if isinstance(recipe.get("keep_softmax"), str) else set())
        assert {k: record["spec"][k] for k in recipe if k in used} == {k: v for k, v in recipe.items() if k in used}
    left = [k for k in recipe if k not in used]
    assert len(lines) == 1 and lines[0].startswith(f"{name} is a recipe of 'linearize {method}'"), lines
    assert lines[0].endswith(": " + ", ".join(left)), lines


def test_convert_reads_a_recipe_file_flags_winning_and_refuses_bad_ones_in_one_line(teacher_dir, tmp_path, capsys):
    import json

    recipe = tmp_path / "long.yaml"
    recipe.write_text(packaged("lolcats_long").read_text() + "keep_softmax: auto:1\nstage1_steps: 3\n")
    out = tmp_path / "student"
    assert main(["convert", "--config", str(recipe), "--teacher", str(teacher_dir), "--window", "8", "--out", str(out),
                 "--device", "cpu"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "leaves" in line)
    assert line.endswith(": budget, block_len, batch_size, data, keep_softmax, stage1_steps")  # auto:1: chosen in training
    spec = json.loads((out / "config.json").read_text())["linearize"]["spec"]
    assert spec["window"] == 8 and spec["decay"] == "gated" and spec["keep_softmax"] == []
    for content, message in [("stage1_stepz: 3\n", "no setting stage1_stepz in any recipe"),
                             ("stage1_steps: 3\nsteps: 4\n", "mixes settings of different recipes"),
                             ("method: supra\nstage1_steps: 3\n", "no setting stage1_steps in the supra recipe"),
                             ("method: delta\nsteps: 3\n", "method must be one of lolcats, supra, xatl"),
                             ("steps: 3\nkeep_softmax: auto:2\n", "chosen by LoLCATs' attention transfer"),
                             ("arch: mamba2\n", "arch must be one of retnet, striped_mamba, mamba"),
                             ("block_len: 64\nkind: mamba\n", "spec kind must be one of")]:
        recipe.write_text(content)
        assert main(["convert", "--config", str(recipe), "--teacher", str(teacher_dir), "--out", str(tmp_path / "o"),
                     "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("linearize: error: ") and message in err and err.count("\n") == 1, (content, err)
        assert not (tmp_path / "o").exists()


def _run(*args, env_extra=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-m", "linearize", *args], capture_output=True, text=True, env=env, timeout=300)
    return proc.returncode, proc.stderr


def _assert_one_line_error(code, stderr, fragment):
    assert code == 2, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("linearize: error:")]
    assert len(errors) == 1 and fragment in errors[0], stderr


def test_bad_input_gives_one_line_and_nonzero_exit(tmp_path, teacher_dir):
    code, err = _run("info", "nonexistent-org/nonexistent-model-xyz")
    _assert_one_line_error(code, err, "could not load teacher 'nonexistent-org/nonexistent-model-xyz'")

    code, err = _run("convert", "--teacher", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "missing.gguf")

    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(os.urandom(1000))
    code, err = _run("convert", "--teacher", str(corrupt), "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "could not read GGUF file")

    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    code, err = _run("convert", "--teacher", str(tmp_path / "gpt2"), "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "unsupported architecture 'gpt2'")

    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    code, err = _run("data", "--source", str(empty), "--tokenizer", str(teacher_dir))
    _assert_one_line_error(code, err, "empty")

    code, err = _run("generate", str(tmp_path / "no-such-checkpoint"))
    _assert_one_line_error(code, err, "no-such-checkpoint")

    recipe = tmp_path / "bad.yaml"
    recipe.write_text("kind: mamba\n")
    code, err = _run("convert", "--config", str(recipe), "--teacher", str(teacher_dir), "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "spec kind must be one of")
    assert not (tmp_path / "o").exists()


def test_convert_with_no_spec_builds_the_student_lolcats_trains_by_default(teacher_dir, tmp_path, capsys):
    """No --kind and no --config: the default spec of ``linearize lolcats`` (flags change it); ``--config
    lolcats_plain`` the paper's student; another kind takes none of the LoLCATs defaults."""
    import json

    from linearize.recipes.settings import DEFAULT_SPEC

    def spec_of(*flags):
        out = tmp_path / f"s{len(list(tmp_path.iterdir()))}"
        assert main(["convert", "--teacher", str(teacher_dir), "--out", str(out), "--device", "cpu", *flags]) == 0
        capsys.readouterr()
        return json.loads((out / "config.json").read_text())["linearize"]["spec"]

    default = spec_of()
    assert {k: default[k] for k in DEFAULT_SPEC} == DEFAULT_SPEC and default["decay"] == "gated"
    assert spec_of("--window", "8") == {**default, "window": 8}
    plain = spec_of("--config", "lolcats_plain")
    assert plain["decay"] == "none" and plain["feature_rope"] is True and plain["window"] == 64
    supra = spec_of("--kind", "supra")
    assert supra["kind"] == "supra" and supra.get("decay") != "gated"


def test_keep_softmax_flag_wins_over_a_recipe_files_auto_choice():
    """--keep-softmax over a file's ``auto:K``: the flag's layers, and the file's way of choosing (auto_softmax_score,
    auto_softmax_distance) dropped rather than refused as asking for a choice nobody makes."""
    from linearize.cli import _recipe_config, build_parser
    from linearize.recipes import lolcats

    def config(*flags):
        args = build_parser().parse_args(["lolcats", "--config", "lolcats_wide", *flags])
        return _recipe_config(args, lolcats.LolcatsConfig, lolcats.apply_budget, "runs/lolcats", lolcats.DEFAULT_SPEC)

    chosen = config()
    assert chosen.keep_softmax == "auto:0.47" and chosen.auto_softmax_score == "recall"
    fixed = config("--keep-softmax", "0,1,17")
    assert fixed.keep_softmax == (0, 1, 17) and fixed.spec["softmax_window"] == 1280
    assert fixed.auto_softmax_score == lolcats.LolcatsConfig().auto_softmax_score
    assert fixed.auto_softmax_distance == lolcats.LolcatsConfig().auto_softmax_distance
    fewer = config("--keep-softmax", "auto:4")  # another auto:K chooses as the file says
    assert fewer.keep_softmax == "auto:4" and fewer.auto_softmax_score == "recall" and fewer.auto_softmax_distance == 1024
