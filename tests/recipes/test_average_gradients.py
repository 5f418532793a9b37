"""``recipes.engine.average_gradients``: what DDP's hooks do for CUDA-graph steps under torchrun."""

import os
import subprocess
import sys
from pathlib import Path


def test_two_processes_end_with_the_mean_gradient():
    script = Path(__file__).with_name("average_gradients.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "averaged" in run.stdout, run.stdout[-2000:]
