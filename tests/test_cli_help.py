"""Instant help: ``linearize --help`` and ``linearize <command> --help`` build the parser without torch,
transformers or the other heavy libraries (the commands import them when they run).

Each ``--help`` runs in a subprocess as ``python -m linearize`` behind a ``sys.meta_path`` finder that
refuses those imports and records every attempt; the process must print its usage, exit 0, and have
attempted none."""

import argparse
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy", "peft", "lm_eval", "accelerate", "matplotlib")

PROBE = """
import runpy, sys
HEAVY = {heavy!r}
attempted = []

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HEAVY:
            attempted.append(name)
            raise ImportError(f"--help must not import {{name}}")
        return None

sys.meta_path.insert(0, Refuse())
sys.argv = ["linearize", *{args!r}]
try:
    runpy.run_module("linearize", run_name="__main__", alter_sys=True)
finally:
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in HEAVY)
    sys.stderr.write(f"\\nHEAVY-IMPORTS attempted={{sorted(set(attempted))}} loaded={{loaded}}\\n")
"""


def _commands(parser=None, prefix=()):
    """Every command path of the CLI: (), ("convert",), ..., ("data", "generate")."""
    if parser is None:
        from linearize.cli import build_parser

        parser = build_parser()
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*prefix, name))
    return found


COMMANDS = _commands()


def test_every_command_is_probed():
    names = {c[0] for c in COMMANDS if c}
    assert {"convert", "generate", "info", "lolcats", "supra", "xatl", "orderings", "bench", "data", "eval",
            "report"} <= names
    assert ("data", "generate") in COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "linearize")
def test_help_imports_no_heavy_library(command, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY, args=[*command, "--help"])],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    report = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: linearize"), proc.stdout[:500]
    assert report == "HEAVY-IMPORTS attempted=[] loaded=[]", proc.stderr[-3000:]


def test_the_probe_catches_a_heavy_import(tmp_path):
    """The finder is live: the same probe on a command that does import torch reports it."""
    code = PROBE.format(heavy=HEAVY, args=["--version"]).replace(
        'runpy.run_module("linearize", run_name="__main__", alter_sys=True)',
        'import linearize; linearize.load')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode != 0 and "attempted=['torch'" in proc.stderr, proc.stderr[-2000:]
