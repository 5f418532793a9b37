"""A frozen teacher sharded like an FSDP student (``FrozenTeacher(shard=True)``), on 2 gloo processes."""

from pathlib import Path

from helpers import run_two_processes


def test_a_sharded_frozen_teacher_gives_the_whole_copys_outputs():
    assert "sharded teacher agrees" in run_two_processes(Path(__file__).with_name("frozen_teacher_fsdp.py"))
