"""Bad arguments: one ``linearize: error:`` line, exit status 2, no traceback, and before any model,
data or teacher loads (in-process, well under 5 s). The checkpoint cases (no tokenizer files, a
``linearize`` entry without a spec) are in test_checkpoint_meta.py, the data cases (a file that is
not text, ``--block-len 0``) in test_data_cli.py, the teacher cases (a missing path, an unknown hub
id offline) in test_teacher_sources.py."""

import time

import pytest

from linearize.cli import main

CASES = [  # (arguments, what the line says)
    ("lolcats --batch-size 0", "--batch-size must be a positive whole number"),
    ("lolcats --grad-accum 0", "--grad-accum must be a positive whole number"),
    ("lolcats --rows swap-finetune --lora-r 0", "--lora-r must be a positive whole number"),
    ("lolcats --layers-per-block 0", "--layers-per-block must be a positive whole number"),
    ("lolcats --eval-steps 0", "--eval-steps must be a positive whole number"),
    ("lolcats --window 0", "--window must be a positive whole number"),
    ("supra --steps 0", "--steps must be a positive whole number"),
    ("xatl --lr -1", "--lr must be positive"),
    ("bench default --batch-sizes 0", "--batch-sizes must be positive whole numbers"),
    ("bench default --new-tokens 16 0", "--new-tokens must be positive whole numbers"),
    ("generate default --max-new-tokens -1", "--max-new-tokens must be a positive whole number"),
    ("generate default --temperature -1", "--temperature must be zero or more"),
    ("generate default --temperature 0.7 --top-p 1.5", "--top-p must be in (0, 1]"),
    ("convert --window 0 --out {dir}/ck", "--window must be a positive whole number"),
    ("convert --out {file}", "is a file; the command writes a folder there"),
    ("lolcats --out {file}", "is a file; the command writes a folder there"),
    ("eval default --out {dir}", "is a folder; give a file name for the JSON results"),
]


@pytest.fixture(scope="module", autouse=True)
def _imports():
    """Import what the commands import, so the time bound measures the checks, not Python's imports."""
    import linearize.recipes.lolcats  # noqa: F401
    import linearize.recipes.uptrain  # noqa: F401


@pytest.mark.parametrize("argv, message", CASES, ids=[c[0] for c in CASES])
def test_a_bad_argument_is_one_line_before_anything_loads(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))  # nothing cached to fall back on
    (tmp_path / "file").write_text("keep me\n")
    (tmp_path / "dir").mkdir()
    args = argv.format(file=tmp_path / "file", dir=tmp_path / "dir").split()
    start = time.perf_counter()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("linearize: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert time.perf_counter() - start < 5
    assert (tmp_path / "file").read_text() == "keep me\n"  # nothing already there is lost


def test_a_full_disk_is_one_line_and_other_failures_still_raise(tmp_path, capsys, monkeypatch):
    """A write that finds no space left (an OSError with ENOSPC, or safetensors' own error wrapping one, as an
    8B checkpoint's optimizer state did on a 128 GB disk) ends with one line naming --keep-checkpoints."""
    import errno

    from linearize import cli

    class SafetensorError(Exception):  # safetensors' Rust error is no OSError; its text is what says so
        pass

    def failing(error):
        def run(args):
            raise error
        return run

    out = tmp_path / "run"
    for error in (OSError(errno.ENOSPC, "No space left on device"),
                  SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")):
        monkeypatch.setattr(cli, "cmd_supra", failing(error))
        assert main(["supra", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("linearize: error: no space left on the device writing under")
        assert str(out) in err and "--keep-checkpoints" in err
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert cli.disk_full(wrapped) and not cli.disk_full(OSError(errno.EACCES, "Permission denied"))
    monkeypatch.setattr(cli, "cmd_supra", failing(OSError(errno.EACCES, "Permission denied")))
    with pytest.raises(PermissionError):
        main(["supra", "--out", str(out)])
