"""Fused projections while decoding (``linearize.decode.fused``): q/k/v and an MLP's gate/up as one product
each, the same tokens and logits as the separate products, and every module restored afterwards."""

import pytest
import torch
from torch import nn

from helpers import plain_generate, tiny_student

from linearize.convert import mixers
from linearize.decode import FastDecoder, fast_generate, fused_projections
from linearize.models.fusion import FusedGatedMLP, fusable

LOLCATS = {"kind": "lolcats", "window": 4, "feature_dim": 8}
GATED = {**LOLCATS, "decay": "gated", "feature_rope": False}  # lolcats_long's mixer: its gate joins the q/k/v product
CASES = [
    ("llama", LOLCATS),
    ("llama", GATED),
    ("llama", {"kind": "supra"}),
    ("qwen2", LOLCATS),  # q/k/v biases
    ("llama", {**LOLCATS, "keep_softmax": [1]}),  # a kept softmax layer stays the teacher's
    ("qwen3", {"kind": "supra"}),  # q_norm / k_norm after the split
    ("gemma", LOLCATS),  # gelu MLP, multi-query keys
]


def _student(tiny_model, family, spec):
    """``tiny_student``, with its gates' projections (zero at conversion) set at random so they count."""
    model = tiny_student(tiny_model, family, spec)
    with torch.no_grad():
        for m in mixers(model).values():
            if getattr(m, "gate_proj", None) is not None:
                m.gate_proj.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(m.layer_idx))
    return model


def _ids(b=2, t=9, seed=0):
    return torch.randint(2, 97, (b, t), generator=torch.Generator().manual_seed(seed))




def _mlps(model):
    return [layer.mlp for layer in model.model.layers]


def _snapshot(model):
    """Every module's own attributes, and every parameter (the object and a copy of its value),
    after a plain forward (mixers keep the last call's padding mask as an attribute)."""
    with torch.no_grad():
        model(_ids(b=1, t=3))
    attrs = {name: dict(vars(m)) for name, m in model.named_modules()}
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    return attrs, params


def _assert_untouched(model, snapshot):
    attrs, params = snapshot
    for name, m in model.named_modules():
        assert vars(m).keys() == attrs[name].keys(), name
        assert "fused_qkv" not in m._modules and not isinstance(m, FusedGatedMLP) and "forward" not in vars(m), name
    assert [name for name, _ in model.named_modules()] == list(attrs)
    now = dict(model.named_parameters())
    assert now.keys() == params.keys()
    for name, (p, value) in params.items():
        assert now[name] is p and torch.equal(p, value), name


class _Watch:
    """A streamer that looks at the model while the decoder runs."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def put(self, x):
        self.seen.append(([hasattr(m, "fused_qkv") for m in mixers(self.model).values()],
                          [isinstance(mlp, FusedGatedMLP) for mlp in _mlps(self.model)]))

    def end(self):
        pass


# --------------------------------------------------------------------------- same tokens


@pytest.mark.parametrize("family,spec", CASES)
def test_fused_greedy_equals_unfused_and_generate(tiny_model, family, spec):
    model = _student(tiny_model, family, spec)
    prompt = _ids()
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0  # a left-padded sequence
    prompt = prompt.masked_fill(mask == 0, 0)
    snap = _snapshot(model)
    ref = plain_generate(model, prompt, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    plain = fast_generate(model, prompt, mask, max_new_tokens=12, pad_token_id=0, fuse_projections=False)
    watch = _Watch(model)
    fused = fast_generate(model, prompt, mask, max_new_tokens=12, pad_token_id=0, streamer=watch)
    assert torch.equal(fused, plain) and torch.equal(fused, ref)
    # fused while it ran (every converted layer, every MLP), untouched afterwards
    assert watch.seen and all(all(q) and all(f) for q, f in watch.seen)
    _assert_untouched(model, snap)


def test_fusion_off_leaves_the_modules_alone_while_decoding(tiny_model):
    model = tiny_student(tiny_model, "llama", LOLCATS)
    watch = _Watch(model)
    FastDecoder(model, fuse_projections=False).generate(_ids(), max_new_tokens=4, streamer=watch)
    assert watch.seen and not any(any(q) or any(f) for q, f in watch.seen)


# --------------------------------------------------------------------------- same function


@pytest.mark.parametrize("family,spec", CASES + [("llama", None)])
def test_one_forward_inside_equals_outside(tiny_model, family, spec):
    """float64 logits of a forward (prefill shape and one cached step) with and without fusion;
    ``spec`` None is the softmax teacher itself (only its MLPs fuse)."""
    model = _student(tiny_model, family, spec) if spec else tiny_model(family, dtype=torch.float64)
    ids = _ids(t=10)
    snap = _snapshot(model)
    with torch.no_grad():
        ref = model(ids).logits
        with fused_projections(model) as n:
            inside = model(ids).logits
        n_mixers = len(mixers(model)) if spec else 0
        assert n == n_mixers + len(_mlps(model))
    assert torch.allclose(inside, ref, atol=1e-10, rtol=0), (inside - ref).abs().max()
    _assert_untouched(model, snap)


def test_a_gated_state_takes_its_gate_from_the_qkv_product(tiny_model):
    """lolcats_long's gates: the gate projection is a fourth part of the fused q/k/v product while decoding
    (one matrix product fewer a layer), and the log gates are the same as from the gate's own projection."""
    model = _student(tiny_model, "llama", GATED)
    layer = next(iter(mixers(model).values()))
    x = torch.randn(2, 5, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with layer.reading(x):
        alone = layer.log_gate(2, 5, x.device)
        assert layer._gate_input is None
    with fused_projections(model):
        sizes = layer.fused_qkv.sizes
        with layer.reading(x):
            layer.adapter.qkv(layer, x)
            assert layer._gate_input is not None
            fused = layer.log_gate(2, 5, x.device)
        assert layer._gate_input is None  # nothing kept past the call
    g = layer.geometry
    assert sizes == (g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim, g.n_kv_heads * g.head_dim, g.n_kv_heads)
    assert alone.abs().max() > 0 and torch.allclose(fused, alone, atol=1e-12, rtol=0)


def test_weights_are_read_afresh_on_every_call(tiny_model):
    model = tiny_student(tiny_model, "qwen2", LOLCATS)
    prompt = _ids()
    decoder = FastDecoder(model)
    before = decoder.generate(prompt, max_new_tokens=10)
    layer = model.model.layers[0]
    with torch.no_grad():  # change q/k/v and gate/up between calls
        for lin in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.up_proj):
            lin.weight.add_(torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(5),
                                        dtype=lin.weight.dtype))
        layer.self_attn.k_proj.bias.add_(1.0)
    after = decoder.generate(prompt, max_new_tokens=10)
    assert not torch.equal(after, before)
    assert torch.equal(after, FastDecoder(model, fuse_projections=False).generate(prompt, max_new_tokens=10))
    assert torch.equal(after, plain_generate(model, prompt, max_new_tokens=10, do_sample=False))


# --------------------------------------------------------------------------- restored


def test_restored_after_an_exception(tiny_model):
    model = tiny_student(tiny_model, "llama", LOLCATS)
    snap = _snapshot(model)
    with pytest.raises(RuntimeError, match="boom"), fused_projections(model):
        assert all(hasattr(m, "fused_qkv") for m in mixers(model).values())
        raise RuntimeError("boom")
    _assert_untouched(model, snap)

    class Fails:
        def put(self, x):
            if len(x.shape) == 1:  # a new token: fail in the middle of decoding
                raise RuntimeError("boom")

        def end(self):
            pass

    with pytest.raises(RuntimeError, match="boom"):
        fast_generate(model, _ids(), max_new_tokens=5, streamer=Fails())
    _assert_untouched(model, snap)
    # training afterwards sees the separate projections, with gradients to each
    model.train()
    model(_ids(), labels=_ids()).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.endswith(("q_proj.weight", "gate_proj.weight")))


def test_only_exactly_equivalent_projections_fuse():
    def lin(bias=True, dtype=torch.float64, n_in=8):
        return nn.Linear(n_in, 4, bias=bias, dtype=dtype)

    assert fusable(lin(), lin(), lin()) and fusable(lin(False), lin(False))
    assert not fusable(lin(), lin(False))  # biases mixed
    assert not fusable(lin(), lin(dtype=torch.float32))  # dtypes mixed
    assert not fusable(lin(), lin(n_in=6))
    assert not fusable(lin(), None)
    hooked = lin()
    hooked.register_forward_hook(lambda *a: None)
    assert not fusable(lin(), hooked)

    class Subclass(nn.Linear):
        pass

    assert not fusable(lin(), Subclass(8, 4, dtype=torch.float64))


def test_a_fused_product_of_an_odd_width_is_padded_to_aligned_rows_and_returns_exactly_the_outputs():
    """q/k/v plus a gate (SmolLM2: 576 + 192 + 192 + 3) would give rows 963 wide, which cuBLAS serves with its
    unvectorised kernels: the weight gets zero rows up to a multiple of 8, and the padding never comes out."""
    from linearize.models.fusion import ALIGN, FusedLinear

    gen = torch.Generator().manual_seed(0)
    for widths, bias in (((6, 3, 3, 1), True), ((6, 3, 3, 1), False), ((8, 4, 4), True)):
        linears = [nn.Linear(5, n, bias=bias, dtype=torch.float64) for n in widths]
        for m in linears:
            nn.init.normal_(m.weight, generator=gen)
        fused = FusedLinear.of(*linears)
        width = sum(widths)
        assert fused.weight.shape[0] == -(-width // ALIGN) * ALIGN and fused.sizes == widths
        x = torch.randn(2, ALIGN, 5, dtype=torch.float64, generator=gen)
        with torch.no_grad():  # inference (decoding): the fused product (under autograd the linears run)
            product = fused.product(x)
        assert product.shape == (2, ALIGN, width) and product.stride(1) == fused.weight.shape[0]
        assert torch.allclose(product, torch.cat([m(x) for m in linears], -1), atol=1e-12, rtol=0)
        for got, m in zip(fused(x), linears, strict=True):
            assert torch.allclose(got, m(x), atol=1e-12, rtol=0)
        if width % ALIGN == 0:
            assert product.is_contiguous() and "padding" not in fused.extra_repr()
        else:
            assert "padding=" in fused.extra_repr()
        one = x[:1, :1]  # one row (batch-1 decoding): the weight without its padding rows, the same outputs
        with torch.no_grad():
            single = fused.product(one)
        assert single.is_contiguous() and single.shape == (1, 1, width)
        assert torch.allclose(single, product[:1, :1], atol=1e-12, rtol=0)


# --------------------------------------------------------------------------- LoRA


def test_lora_wrapped_projections_stay_unfused(tiny_model):
    from peft import LoraConfig, get_peft_model

    model = tiny_student(tiny_model, "llama", LOLCATS)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                  target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # LoRA starts as a no-op (B = 0): make it count
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    student = peft_model.get_base_model()
    snap = _snapshot(student)
    with torch.no_grad(), fused_projections(student) as n:
        assert n == len(_mlps(student))  # the MLPs only: q/k/v of every converted layer stay separate
        assert not any(hasattr(m, "fused_qkv") for m in mixers(student).values())
    prompt = _ids()
    ref = plain_generate(student, prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    unfused = fast_generate(student, prompt, max_new_tokens=10, pad_token_id=0, fuse_projections=False)
    assert torch.equal(fast_generate(student, prompt, max_new_tokens=10, pad_token_id=0), ref)
    assert torch.equal(unfused, ref)
    _assert_untouched(student, snap)


@pytest.mark.slow
def test_compiled_step_with_and_without_fusion(tiny_model):
    """torch.compile'd steps decode the same tokens fused and unfused, and a second fused call
    reuses the compiled step (the fused weights are new tensors, the instance forward a new method)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_student(tiny_model, "qwen2", LOLCATS, dtype=torch.float32)
    prompt = _ids()
    plain = fast_generate(model, prompt, max_new_tokens=10, fuse_projections=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        assert torch.equal(fast_generate(model, prompt, max_new_tokens=10, compile=True), plain)
        assert torch.equal(fast_generate(model, prompt, max_new_tokens=10, compile=True), plain)
