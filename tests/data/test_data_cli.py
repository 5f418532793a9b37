"""``linearize data``: arguments checked before anything loads, only a tokenizer loaded, files that
are not text refused with one line."""

import os
import re
import subprocess
import sys

import pytest

from linearize.cli import main
from linearize.errors import LinearizeError

from helpers import tiny_tokenizer


@pytest.fixture(autouse=True)
def linearize_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "linearize-home"))


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A folder holding a tokenizer and nothing else: no config.json, no weights."""
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    return tmp_path / "tokenizer"


def _run(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "linearize", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    return proc.returncode, proc.stderr


def _assert_one_line_error(code, stderr, *fragments):
    assert code == 2, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("linearize: error:")]
    assert len(errors) == 1, stderr
    for fragment in fragments:
        assert fragment in errors[0], stderr


def test_block_len_zero_fails_before_the_tokenizer_loads(tmp_path):
    # the tokenizer named does not exist: had it been loaded first, that would be the error
    code, err = _run("data", "--block-len", "0", "--tokenizer", str(tmp_path / "no-such-teacher"))
    _assert_one_line_error(code, err, "--block-len", "0")


def test_a_missing_source_fails_before_the_tokenizer_loads(tmp_path, monkeypatch, capsys):
    from linearize import teacher

    monkeypatch.setattr(teacher, "load_tokenizer", lambda *a, **k: pytest.fail("loaded a tokenizer"))
    assert main(["data", "--data", str(tmp_path / "nope.txt")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_random_bytes_named_txt_are_refused(tmp_path, tokenizer_dir):
    noise = tmp_path / "noise.txt"
    noise.write_bytes(os.urandom(200_000))
    code, err = _run("data", "--data", str(noise), "--tokenizer", str(tokenizer_dir), "--block-len", "16")
    _assert_one_line_error(code, err, "noise.txt", "not a text file")


def test_only_the_tokenizer_is_loaded(tmp_path, tokenizer_dir, capsys, monkeypatch):
    """A tokenizer folder with no model in it is enough, and no model loader is called."""
    from linearize import teacher

    monkeypatch.setattr(teacher, "load_teacher", lambda *a, **k: pytest.fail("loaded a model"))
    text = tmp_path / "counting.txt"
    text.write_text(" ".join(f"w{2 + i % 90}" for i in range(2000)))
    assert main(["data", "--data", str(text), "--tokenizer", str(tokenizer_dir), "--block-len", "64"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^train: \d+ blocks of 64 tokens", out, re.M) and "validation: 1 blocks of 64 tokens" in out


@pytest.mark.parametrize("content, why", [
    (b"plain words\x00and a NUL", "NUL bytes"),
    (bytes(range(1, 32)) * 20 + b"some words", "control characters"),
    ("caf\u00e9 na\u00efve".encode("utf-16"), "NUL bytes"),
])
def test_files_that_are_not_text(tmp_path, content, why):
    from linearize.data import read_texts

    path = tmp_path / "data.txt"
    path.write_bytes(content)
    with pytest.raises(LinearizeError, match=why) as excinfo:
        read_texts(path)
    assert "data.txt" in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_text_with_a_few_control_characters_and_latin1_is_read(tmp_path):
    from linearize.data import read_texts

    path = tmp_path / "ok.txt"
    path.write_bytes("caf\u00e9, na\u00efve\tcolumns\f\n".encode("latin-1") * 50 + b"\x1b[0m")
    assert read_texts(path)[0].startswith("caf\u00e9, na\u00efve")
