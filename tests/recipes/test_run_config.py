"""The run configuration is declared once: each recipe command's flags are derived from its config's
fields (``linearize.recipes.config``), so a flag and a YAML key are the same setting."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from linearize.cli import SPEC_FLAGS, build_parser
from linearize.recipes.config import RunConfig, add_flags, setting
from linearize.recipes.lolcats import LolcatsConfig
from linearize.recipes.supra import SupraConfig
from linearize.recipes.xatl import XatlConfig

# flags that are not settings of the recipe's config: the command's own, the shared --dtype/--device,
# and the mixer spec's (which go into ``spec``)
NOT_SETTINGS = {"help", "dtype", "device", "teacher", "budget", "out", "config", "rows", "variant", "table", "losses",
                "second_seed",
                *SPEC_FLAGS}


def _command(name):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _dests(parser):
    return {a.dest for a in parser._actions} - NOT_SETTINGS


def _flagged(cls):
    return {f.name for f in dataclasses.fields(cls)
            if any(getattr(k, "__dataclass_fields__", {}).get(f.name) is not None
                   and getattr(k, "__dataclass_fields__")[f.name].metadata.get("help") for k in cls.__mro__)}


@pytest.mark.parametrize("command,cls,left_out", [
    ("lolcats", LolcatsConfig, set()),
    ("supra", SupraConfig, {"weight_decay"}),
    ("xatl", XatlConfig, set()),
    # its rows vary the recipe's own settings; the XATL tables take the architecture and LIT's
    ("orderings", XatlConfig, {"weight_decay", "loss", "transfer", "freeze"}),
])
def test_recipe_flags_are_the_config_settings(command, cls, left_out):
    names = {f.name for f in dataclasses.fields(cls)}
    dests = _dests(_command(command))
    assert dests <= names, f"{command} has flags that are no setting of {cls.__name__}: {dests - names}"
    assert dests == _flagged(cls) - left_out


def test_shared_settings_are_declared_once():
    shared = {f.name for f in dataclasses.fields(RunConfig)}
    for cls in (LolcatsConfig, SupraConfig, XatlConfig):
        assert issubclass(cls, RunConfig) and shared <= {f.name for f in dataclasses.fields(cls)}
    # SUPRA and XATL are separate recipes: neither carries the other's settings
    supra, xatl = ({f.name for f in dataclasses.fields(c)} for c in (SupraConfig, XatlConfig))
    assert "new_weights_first" in supra - xatl and {"arch", "transfer", "freeze"} <= xatl - supra
    assert (XatlConfig().weight_decay, XatlConfig().min_lr, SupraConfig().min_lr) == (0.1, 3e-5, 1e-5)
    # a redeclared default keeps the shared help
    help_of = {a.dest: a.help for a in _command("lolcats")._actions}
    assert help_of["eval_steps"] == help_of_supra("eval_steps") == "evaluate (and checkpoint) every N steps"
    assert LolcatsConfig().eval_steps == 50 and SupraConfig().eval_steps == 100


def help_of_supra(dest):
    return next(a.help for a in _command("supra")._actions if a.dest == dest)


def test_flag_kinds_and_help_come_from_the_field():
    @dataclasses.dataclass
    class Cfg(RunConfig):
        ratio: float = setting(0.5, "a ratio with 50% in its help")
        count: int | None = setting(None, "how many")
        mode: str = setting("a", "which", choices=("a", "b"))
        switch: bool = setting(False, "turn it on")
        items: tuple[str, ...] | str | None = setting(None, "comma-separated")
        graphs: str = setting("auto", "three ways", choices=("auto", "on", "off"), const="on")

    p = argparse.ArgumentParser()
    add_flags(p, Cfg, ("ratio", "count", "mode", "switch", "items", "graphs", "batch_size"), notes={"ratio": "paper: 1"})
    args = p.parse_args(["--ratio", "0.25", "--count", "3", "--mode", "b", "--switch", "--items", "x,y", "--graphs"])
    assert (args.ratio, args.count, args.mode, args.switch, args.items) == (0.25, 3, "b", True, "x,y")
    assert args.graphs == "on" and p.parse_args(["--graphs", "off"]).graphs == "off"  # a const: the bare flag's value
    assert p.parse_args([]).batch_size is None and p.parse_args([]).switch is None  # unset: the config decides
    assert p.parse_args([]).graphs is None
    for bad in (["--mode", "c"], ["--graphs", "maybe"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    assert "50% in its help (paper: 1)" in p.format_help().replace("\n", " ").replace("  ", " ")
    with pytest.raises(KeyError):
        add_flags(p, Cfg, ("sample_prompt",))  # a setting without help has no flag


def test_paper_values_and_per_command_help():
    lc = {a.dest: a.help for a in _command("lolcats")._actions}
    assert lc["stage1_lr"] == "stage 1 learning rate (paper: 1e-2)"
    assert lc["loss"].startswith("stage 2's loss: lm")
    xa = {a.dest: a for a in _command("xatl")._actions}
    assert xa["lr"].help.endswith("(XATL: 3e-4)") and xa["freeze"].choices == ["frozen", "unfrozen", "lit"]
    assert "qkv" in xa["transfer"].help
