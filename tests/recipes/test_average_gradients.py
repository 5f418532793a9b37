"""``recipes.engine.average_gradients``: what DDP's hooks do for CUDA-graph steps under torchrun."""

from pathlib import Path

from helpers import run_two_processes


def test_two_processes_end_with_the_mean_gradient():
    assert "averaged" in run_two_processes(Path(__file__).with_name("average_gradients.py"))
