"""A recipe killed with SIGKILL (a real ``kill -9`` of the command's process) and run again with
``--resume`` ends as the uninterrupted run: same held-out perplexities and the same final weights
(same seed, 1e-4 relative). LoLCATs is killed in stage 1, between the stages and in stage 2; SUPRA
and XATL mid-run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import linearize

pytestmark = pytest.mark.slow

STEPS = 24  # per stage; a checkpoint every 4 steps


def _args(ws, out: Path, recipe: str) -> list[str]:
    common = ["--teacher", str(ws / "teacher"), "--data", str(ws / "corpus.jsonl"), "--out", str(out),
              "--budget", "cpu", "--block-len", "32", "--batch-size", "4", "--eval-blocks", "4", "--eval-steps", "4",
              "--dtype", "float32", "--device", "cpu"]
    if recipe == "lolcats":
        return ["lolcats", *common, "--feature-dim", "8", "--window", "4", "--stage1-steps", str(STEPS),
                "--stage2-steps", str(STEPS)]
    if recipe == "supra":
        return ["supra", *common, "--steps", str(STEPS), "--lr", "3e-3"]
    return ["xatl", *common, "--arch", "retnet", "--transfer", "embeddings,ffn", "--freeze", "lit",
            "--steps", str(STEPS), "--lr", "3e-3"]


def _env(tmp_path):
    return {**os.environ, "LINEARIZE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TQDM_DISABLE": "1"}


def _run(args, env):
    done = subprocess.run([sys.executable, "-m", "linearize", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _kill_when(args, env, ready) -> None:
    """Start the command and SIGKILL it as soon as ``ready()`` holds."""
    proc = subprocess.Popen([sys.executable, "-m", "linearize", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while proc.poll() is None and not ready() and time.time() < deadline:
        time.sleep(0.005)
    if proc.poll() is not None:
        pytest.fail(f"the run ended (exit {proc.returncode}) before the kill point:\n{proc.stderr.read()[-3000:]}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _complete(checkpoint: Path) -> bool:
    return (checkpoint / "trainer_state.json").exists()


def _same_run(a: Path, b: Path) -> None:
    ra, rb = (json.loads((p / "results.json").read_text()) for p in (a, b))
    assert ra["perplexity"].keys() == rb["perplexity"].keys()
    for key, value in ra["perplexity"].items():
        assert rb["perplexity"][key] == pytest.approx(value, rel=1e-4), key
    ma, _ = linearize.load(a / "final", device="cpu")
    mb, _ = linearize.load(b / "final", device="cpu")
    for (name, pa), (_, pb) in zip(ma.named_parameters(), mb.named_parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def uninterrupted(workspace, tmp_path_factory):
    runs = {}

    def get(recipe):
        if recipe not in runs:
            out = tmp_path_factory.mktemp(f"whole-{recipe}")
            _run(_args(workspace, out / "run", recipe), _env(out))
            runs[recipe] = out / "run"
        return runs[recipe]
    return get


KILL_POINTS = {
    # recipe, where: the path whose appearance triggers the kill (relative to --out)
    "lolcats in stage 1": ("lolcats", lambda out: _complete(out / "stage1" / "joint" / "checkpoint-8")),
    "lolcats between the stages": ("lolcats", lambda out: (out / "stage1" / "joint" / "done").exists()),
    "lolcats in stage 2": ("lolcats", lambda out: _complete(out / "stage2" / "checkpoint-8")),
    "supra mid-run": ("supra", lambda out: _complete(out / "train" / "checkpoint-8")),
    "xatl mid-run": ("xatl", lambda out: _complete(out / "train" / "checkpoint-8")),
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_killed_then_resumed_equals_uninterrupted(point, workspace, uninterrupted, tmp_path):
    recipe, ready = KILL_POINTS[point]
    whole = uninterrupted(recipe)
    out, env = tmp_path / "run", _env(tmp_path)
    args = _args(workspace, out, recipe)
    _kill_when(args, env, lambda: ready(out))
    assert not (out / "results.json").exists()
    _run([*args, "--resume"], env)
    _same_run(whole, out)


def test_a_half_written_checkpoint_is_skipped(tmp_path):
    """A checkpoint the Trainer had not finished (no trainer_state.json, which it writes last, or one
    the kill left empty or cut short) is not resumed from: the latest complete one is, and the torn ones
    are removed."""
    from linearize.recipes.engine import _complete_checkpoint

    for step, state in ((4, "{}"), (8, '{"global_step": 8}\n'), (12, None), (16, ""), (20, '{"global_st')):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        if state is not None:
            (folder / "trainer_state.json").write_text(state)
    assert _complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-8")
    assert all(not (tmp_path / f"checkpoint-{s}").exists() for s in (12, 16, 20))
    assert (tmp_path / "checkpoint-4").exists()
    assert _complete_checkpoint(tmp_path / "checkpoint-4") is None  # no checkpoint inside
