"""The recipes' LoRA (``linearize.recipes.lora``): the fused training forward computes peft's function,
values and gradients, and leaves peft's saving, merging and disabling as they were; the mixers cast
their input once under autocast."""

import pytest
import torch
from helpers import tiny_student

from linearize.mixers import base as mixer_base
from linearize.mixers.base import autocast_input
from linearize.recipes.lora import FusedLoraLinear, add_lora, fuse_lora_products

LOLCATS = {"kind": "lolcats", "window": 4, "feature_dim": 8}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _pair(tiny_model, dtype=torch.float64, targets=TARGETS):
    """The same LoRA student twice: peft's forward, and the fused one (adapters made non-zero)."""
    models = []
    for fused in (False, True):
        student = tiny_student(tiny_model, "llama", LOLCATS, dtype=dtype)
        model = add_lora(student, 4, 8, targets, fused=fused)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # LoRA starts as a no-op (B = 0): make it count
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.3)
        models.append(model)
    return models


def _ids(n=2, t=11):
    return torch.randint(3, 64, (n, t), generator=torch.Generator().manual_seed(1))


def _lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_fused_equals_peft_in_float64_values_and_gradients(tiny_model):
    plain, fused = _pair(tiny_model)
    n_fused = sum(isinstance(m, FusedLoraLinear) for m in fused.modules())
    assert n_fused == 4 * fused.config.num_hidden_layers
    assert not any(isinstance(m, FusedLoraLinear) for m in plain.modules())
    assert fuse_lora_products(fused) == 0  # a second call finds nothing left to change
    ids = _ids()
    out = []
    for model in (plain, fused):
        model.train()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        out.append((loss.detach(), _lora_grads(model)))
    (l0, g0), (l1, g1) = out
    assert torch.allclose(l0, l1, rtol=1e-12, atol=0)
    assert g0.keys() == g1.keys() and len(g0) == 2 * n_fused
    for name in g0:
        assert torch.allclose(g0[name], g1[name], rtol=1e-10, atol=1e-13), name
    assert any(g.abs().sum() > 0 for n, g in g1.items() if "lora_A" in n)  # A learns once B is non-zero


def test_fused_under_bf16_autocast_matches_peft(tiny_model):
    """Autocast (CPU bf16) over fp32 weights, as the recipes train: the output is bf16 and agrees with
    peft's within bf16 rounding (the fused form rounds once where peft rounds three times)."""
    plain, fused = _pair(tiny_model, dtype=torch.float32)
    ids = _ids()
    logits = []
    for model in (plain, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits.append(model(input_ids=ids, use_cache=False).logits.float())
    err = (logits[0] - logits[1]).abs().max() / logits[0].abs().max()
    assert err < 3e-2, err
    layer = next(m for m in fused.modules() if isinstance(m, FusedLoraLinear))
    x = torch.randn(3, 5, layer.in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16


def test_fused_falls_back_where_it_does_not_apply(tiny_model):
    """Adapters disabled, merged, or dtypes that differ outside autocast: peft's own forward, same
    results; the state dict, merging and unloading are peft's."""
    plain, fused = _pair(tiny_model)
    ids = _ids()
    with torch.no_grad():
        base = plain.get_base_model()
        with plain.disable_adapter(), fused.disable_adapter():
            assert torch.equal(plain(input_ids=ids).logits, fused(input_ids=ids).logits)
        ref = fused(input_ids=ids).logits
        assert plain.state_dict().keys() == fused.state_dict().keys()
        merged = fused.merge_and_unload()
        assert not any(isinstance(m, FusedLoraLinear) for m in merged.modules())
        assert torch.allclose(merged(input_ids=ids).logits, ref, rtol=1e-10, atol=1e-12)
        del base
    layer = next(m for m in _pair(tiny_model)[1].modules() if isinstance(m, FusedLoraLinear))
    layer.lora_A["default"].float()  # adapters in fp32 on a fp64 base, no autocast: peft's forward casts
    layer.lora_B["default"].float()
    x = torch.randn(2, layer.in_features, dtype=torch.float64)
    assert layer._fusable(x, (), {}) is None
    assert layer(x).dtype == torch.float64


def test_recipes_and_bench_train_use_the_fused_adapters(tiny_model):
    from linearize.bench.train import stage_setup

    student = tiny_student(tiny_model, "llama", LOLCATS, dtype=torch.float32)
    model, objective = stage_setup(student, "lolcats-stage2")
    assert objective is None
    assert sum(isinstance(m, FusedLoraLinear) for m in model.modules()) == 4 * model.config.num_hidden_layers
    assert {n.split(".")[-2] for n, p in model.named_parameters() if p.requires_grad} == {"default"}


def test_mixer_casts_its_input_once_under_autocast(tiny_model, monkeypatch):
    """Under autocast the converted layers hand q/k/v one cast of their input: the same logits as
    one cast per projection, bit for bit, and gradients within bf16 rounding; no cast without
    autocast, and never a widening one."""
    ids = _ids()
    results = []
    for once in (True, False):
        if not once:
            monkeypatch.setattr(mixer_base, "autocast_input", lambda x: x)
        student = tiny_student(tiny_model, "llama", LOLCATS, dtype=torch.float32)
        student.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = student(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
        results.append((out.logits.detach(), grads))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b)
    for name in ga:
        scale = gb[name].abs().max().clamp_min(1e-12)
        assert ((ga[name] - gb[name]).abs().max() / scale) < 5e-2, name
    x32, x16 = torch.randn(2, 3), torch.randn(2, 3, dtype=torch.bfloat16)
    assert autocast_input(x32) is x32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_input(x32).dtype == torch.bfloat16
        assert autocast_input(x16) is x16
        x8 = torch.randn(2, 3, dtype=torch.float16)
        assert autocast_input(x8) is x8  # same width: left as it is
