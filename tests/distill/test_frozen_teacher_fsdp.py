"""A frozen teacher sharded like an FSDP student (``FrozenTeacher(shard=True)``), on 2 gloo processes."""

import os
import subprocess
import sys
from pathlib import Path


def test_a_sharded_frozen_teacher_gives_the_whole_copys_outputs():
    script = Path(__file__).with_name("frozen_teacher_fsdp.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sharded teacher agrees" in run.stdout, run.stdout[-2000:]
