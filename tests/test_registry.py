"""One registry of mixer kinds (``linearize/kinds.py``): every list of kinds derives from it, and a
kind added there (one line) reaches the spec and ``convert``."""

import pytest
import torch

import linearize
from linearize import kinds


def test_every_list_of_kinds_holds_every_kind():
    from linearize import spec
    from linearize.bench import train as bench_train
    from linearize.convert import xatl_transfer
    from linearize.mixers import MIXERS

    every, built = set(kinds.names()), set(kinds.names("build"))
    assert every == {"lolcats", "linear", "supra", "retnet", "striped_mamba", "delta"}
    assert set(spec.KINDS) == every
    assert set(MIXERS) == every
    assert every <= set(bench_train.MODELS)
    assert built <= set(xatl_transfer.ARCHITECTURES) and set(xatl_transfer.ARCHITECTURES.values()) == built
    assert set(xatl_transfer.DEFAULT_TRANSFER) == built


def test_a_new_kind_is_one_line(tiny_model, monkeypatch):
    """Register a kind (here a renamed linear attention) and it converts and saves."""
    monkeypatch.setitem(kinds.KINDS, "toy", kinds.MixerKind("toy", "linear:LinearAttention", "convert", "a test kind"))
    student = linearize.convert(tiny_model("llama", dtype=torch.float64), {"kind": "toy", "feature_dim": 8})
    assert linearize.spec_of(student).kind == "toy" and len(linearize.mixers(student)) == 3
    with pytest.raises(linearize.LinearizeError, match="kind must be one of"):
        linearize.Spec(kind="toyy")


def test_keep_softmax_is_the_one_name(tiny_model):
    """Layers kept as softmax are keep_softmax in build_xatl, its report and its record."""
    from linearize.convert.xatl_transfer import build_xatl

    teacher = tiny_model("llama")
    student, report = build_xatl(teacher, "retnet", keep_softmax="xatl", seed=0)
    assert report.keep_softmax == (1, 2)  # layers N//2 and 2 of 3
    assert student.config.linearize["keep_softmax"] == [1, 2]
    assert student.config.linearize["xatl"]["keep_softmax"] == [1, 2]
    with pytest.warns(DeprecationWarning):
        build_xatl(teacher, "retnet", hybrid_softmax_layers=[0], seed=0)
