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
