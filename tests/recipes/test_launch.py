"""The ready-made accelerate configurations for several GPUs (``linearize.recipes.launch``)."""

import subprocess
import sys

import pytest
import yaml

from linearize.errors import LinearizeError
from linearize.recipes.launch import CONFIGS, config_path


def test_ddp_and_fsdp_configs_are_accelerate_configs():
    assert set(CONFIGS) >= {"ddp", "fsdp"}
    ddp = yaml.safe_load(config_path("ddp").read_text())
    fsdp = yaml.safe_load(config_path("fsdp").read_text())
    assert ddp["distributed_type"] == "MULTI_GPU" and fsdp["distributed_type"] == "FSDP"
    assert ddp["mixed_precision"] == fsdp["mixed_precision"] == "bf16"
    assert fsdp["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    with pytest.raises(LinearizeError, match="choose from"):
        config_path("zero3")


def test_the_module_prints_a_path_or_one_error_line():
    ok = subprocess.run([sys.executable, "-m", "linearize.recipes.launch", "fsdp"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("fsdp.yaml")
    bad = subprocess.run([sys.executable, "-m", "linearize.recipes.launch", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("linearize: error:") and bad.stderr.count("\n") == 1


def test_stage_two_under_fsdp_is_refused_before_the_teacher_loads(monkeypatch, capsys, tmp_path):
    """LoRA under FSDP is not gathered for merging: refused with one line, before any model loads."""
    import time

    import linearize.recipes.lolcats  # noqa: F401  (imports are not what the bound measures)
    from linearize.cli import main

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    start = time.perf_counter()
    assert main(["lolcats", "--teacher", str(tmp_path / "absent"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linearize: error: stage 2 (LoRA) does not run under FSDP")
    assert err.count("\n") == 1 and time.perf_counter() - start < 5


def test_attention_transfer_under_fsdp_matches_one_process(tmp_path):
    """Two gloo processes with every decoder layer and the model sharded by FSDP2 (as accelerate's
    FSDP config does), each on half the batch: attention transfer's loss and gathered gradients equal
    one unsharded process's on the whole batch. Without the loss's zero-weighted logits term the
    backward meets weights FSDP already freed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers import run_two_processes

    script = Path(__file__).with_name("fsdp_attention_transfer.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "gradients agree" in run_two_processes(script, str(tmp_path))


@pytest.mark.parametrize("recipe", ["supra", "xatl"])
def test_distillation_under_the_fsdp_config_on_two_processes(recipe, workspace, tmp_path):
    """`accelerate launch` with the packaged FSDP config (on the CPU: gloo, no mixed precision): SUPRA or
    XATL with an alignment stage and KL distillation runs end to end on 2 processes, the frozen teacher
    (SUPRA's a copy, XATL's the teacher itself) sharded over both like the student, and the saved
    student stands alone."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    import linearize
    from linearize.recipes.launch import config_path

    cfg = yaml.safe_load(config_path("fsdp").read_text())
    cfg.update(use_cpu=True, mixed_precision="no")
    (tmp_path / "fsdp_cpu.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "LINEARIZE_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp_cpu.yaml"),
         "--num_processes", "2", "-m", "linearize", recipe, "--teacher", str(workspace / "teacher"),
         "--data", str(workspace / "corpus.jsonl"), "--out", str(tmp_path / "run"), "--budget", "cpu",
         "--block-len", "32", "--batch-size", "2", "--eval-blocks", "4", "--steps", "4", "--eval-steps", "2",
         "--dtype", "float32", "--device", "cpu", "--loss", "kl+lm", "--align-steps", "2",
         *(["--arch", "retnet", "--transfer", "embeddings,ffn"] if recipe == "xatl" else [])],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sharded over 2 processes" in done.stdout, done.stdout[-2000:]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["teacher_sharded_over"] == 2 and res["train"]["steps"] == 6
    assert res["train"]["tokens"] == 6 * 2 * 32 * 2  # both processes' batches
    model, _ = linearize.load(tmp_path / "run" / "final", device="cpu")
    assert linearize.mixers(model)
