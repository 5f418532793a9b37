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


def test_stage_one_under_fsdp_is_refused_before_the_teacher_loads(monkeypatch, capsys, tmp_path):
    """Attention transfer's per-layer losses bypass FSDP's backward hooks (on two H200s the backward
    met a freed weight): refused with one line, before any model loads."""
    import time

    import linearize.recipes.lolcats  # noqa: F401  (imports are not what the bound measures)
    from linearize.cli import main

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    start = time.perf_counter()
    assert main(["lolcats", "--teacher", str(tmp_path / "absent"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linearize: error: stage 1 (attention transfer) does not run under FSDP")
    assert err.count("\n") == 1 and time.perf_counter() - start < 5
