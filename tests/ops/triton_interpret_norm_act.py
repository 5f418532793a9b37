"""Run by test_norm_act_triton.py and tests/decode/test_fused_kernels.py in a subprocess, on the CPU through
Triton's interpreter: the fast decoder's RMSNorm and gated-activation kernels (``ops/rms_norm_triton.py``,
``ops/gated_act_triton.py``) against the modules they stand in for, and the fast decoder with them forced on.

Parts (arguments; all by default):

* ``norm``: ``rms_norm_triton`` against Llama's, Qwen3's (a per-head q/k norm on a view of the fused q/k/v
  product) and Gemma's ``(1 + weight)`` RMSNorm modules in fp32, bf16 (also with fp32 weights) and fp16:
  rows across several programs, one row, rows longer than a power of 2, a row longer than one tile;
* ``add_norm``: ``add_rms_norm_triton`` (a layer's residual add and the norm after it) against the add and the module;
* ``act``: ``gated_act_triton`` against ``act_fn(gate) * up`` of Llama's (SiLU) and Gemma's (GELU, tanh form)
  MLPs, and the stand-in modules (``FusedRMSNorm``, ``FusedGatedMLP`` with the kernel) against the originals;
* ``decoder``: ``FastDecoder(fuse_kernels=True)`` (as on CUDA) against the PyTorch modules and ``generate()``,
  token for token, with the kernels called and a decode step's PyTorch operators counted.

fp32 agrees to rounding (the sum of squares in another order). 16-bit outputs must equal the module's bit for
bit almost everywhere: the kernels round where the modules round (a misplaced rounding shows as many
one-bit differences). Triton 3.9's interpreter truncates fp32 -> bf16 casts where CUDA rounds to nearest
even; ``interpret_checks.round_bf16_like_cuda`` makes it round as the GPU does.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from interpret_checks import round_bf16_like_cuda  # noqa: E402
from linearize.ops import gated_act_triton as gat  # noqa: E402
from linearize.ops import rms_norm_triton as rnt  # noqa: E402


round_bf16_like_cuda()  # for the whole script


def agree(got, want, what, exact_share=0.97, unit=None):
    """fp32: close to rounding; 16-bit: the same dtype, bit for bit on ``exact_share`` of the entries and
    two units in the last place at most elsewhere (a rounding of the normalised value, then of the product; or
    1e-5 of the largest entry: GELU's far tail, where
    PyTorch's ``1 + tanh`` cancels and the kernel's exp form does not)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    g, w = got.double(), want.double()
    unit = unit or want.dtype  # the coarsest rounding on the way (fp32 output of bf16 input: bf16)
    if unit == torch.float32:
        err = ((g - w).abs().max() / w.abs().max()).item()
        assert err < 2e-6, (what, err)
        return
    share = (got == want).double().mean().item()
    ulp = w.abs() * (2.0 ** -6 if unit == torch.bfloat16 else 2.0 ** -9) + 1e-5 * w.abs().max()
    worst = ((g - w).abs() / ulp).max().item()
    assert share >= exact_share and worst <= 1, (what, share, worst)


def _family(name, **overrides):
    from transformers import AutoModelForCausalLM

    from helpers import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(name, **overrides)).eval()


def _randomise(module, g, around=0.0):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + around)


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float16)]


def check_norm():
    g = torch.Generator().manual_seed(0)
    llama = _family("llama", hidden_size=40, num_attention_heads=5, num_key_value_heads=1).model.norm
    gemma = _family("gemma", hidden_size=40, num_attention_heads=5).model.norm
    qwen3 = _family("qwen3").model.layers[0].self_attn.q_norm  # head_dim 8
    seen = set()
    for name, norm, around in (("llama", llama, 1.0), ("gemma", gemma, 0.0), ("qwen3", qwen3, 1.0)):
        _randomise(norm, g, around)
        d = norm.weight.shape[0]
        for x_dtype, w_dtype in DTYPES:
            if name == "gemma" and w_dtype != x_dtype:
                continue  # Gemma's output is x's dtype whatever the weight's: the first case covers it
            mod = norm.to(w_dtype)
            eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
            shapes = [(3, 7), (1, 1), (41,)] if name != "qwen3" else [(2, 3)]
            for shape in shapes:
                if name == "qwen3":  # q as the adapter views it: [B, T, H, D] inside the fused product's rows
                    qkv = (torch.randn(*shape, (6 + 2 * 3) * d, generator=g) * 3 + 0.5).to(x_dtype)
                    x = qkv[..., : 6 * d].view(*shape, 6, d)
                    assert not x.is_contiguous()
                else:
                    x = (torch.randn(*shape, d, generator=g) * 3 + 0.5).to(x_dtype)
                got = rnt.rms_norm_triton(x, mod.weight, eps, offset=name == "gemma")
                agree(got, mod(x), (name, x_dtype, w_dtype, shape), unit=x_dtype)
                assert got.is_contiguous()
                seen.add((name, x_dtype, w_dtype))
    # a row longer than one program's tile would be split across programs if the kernel tiled rows: one row
    # of 5000 (BLOCK_D 8192), and several rows per program with the tile made small (partial last program)
    long = _family("llama", hidden_size=5000, num_attention_heads=4, num_key_value_heads=1,
                   num_hidden_layers=1, intermediate_size=8, vocab_size=8).model.norm
    _randomise(long, g, 1.0)
    x = torch.randn(2, 5000, generator=g).bfloat16()
    agree(rnt.rms_norm_triton(x, long.weight.bfloat16(), long.variance_epsilon), long.bfloat16()(x), "long rows")
    rnt.TILE, tile = 64, rnt.TILE  # 64 // BLOCK_D 64 = 1, 40 -> 64: one row a program; 16 -> 4 rows a program
    try:
        for d in (40, 16):
            norm = _family("llama", hidden_size=d, num_attention_heads=4, num_key_value_heads=1,
                           num_hidden_layers=1).model.norm
            _randomise(norm, g, 1.0)
            x = torch.randn(13, d, generator=g)
            agree(rnt.rms_norm_triton(x, norm.weight, norm.variance_epsilon), norm(x), ("small tile", d))
    finally:
        rnt.TILE = tile
    assert len(seen) == 11, seen


def check_add_norm():
    """``add_rms_norm_triton``: the residual add and the norm after it, against the layer's ``residual + x`` (bit
    for bit) and the module on that sum, Llama's and Gemma's norms, fp32 / bf16 / fp16, rows across programs."""
    from linearize.ops.norm_act import add_rms_norm

    g = torch.Generator().manual_seed(1)
    llama = _family("llama", hidden_size=40, num_attention_heads=5, num_key_value_heads=1).model.norm
    gemma = _family("gemma", hidden_size=40, num_attention_heads=5).model.norm
    for name, norm, around in (("llama", llama, 1.0), ("gemma", gemma, 0.0)):
        _randomise(norm, g, around)
        for x_dtype, w_dtype in DTYPES:
            if name == "gemma" and w_dtype != x_dtype:
                continue
            mod = norm.to(w_dtype)
            eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
            for shape in ((3, 7), (1, 1), (41,)):
                x = (torch.randn(*shape, 40, generator=g) * 3).to(x_dtype)
                r = (torch.randn(*shape, 40, generator=g) * 3 + 0.5).to(x_dtype)
                normed, summed = rnt.add_rms_norm_triton(x, r, mod.weight, eps, offset=name == "gemma")
                assert torch.equal(summed, r + x), (name, x_dtype, shape)  # the layer's own add, rounded alike
                agree(normed, mod(r + x), (name, x_dtype, w_dtype, shape, "add"), unit=x_dtype)
                twin = add_rms_norm(x, r, mod.weight, eps, offset=name == "gemma")
                assert torch.equal(twin[1], summed) and twin[0].dtype == normed.dtype


def check_act():
    from linearize.models.fusion import FusedGatedMLP, FusedRMSNorm

    g = torch.Generator().manual_seed(1)
    for family, act in (("llama", "silu"), ("gemma", "gelu_tanh")):
        model = _family(family, intermediate_size=72)
        mlp = model.model.layers[0].mlp
        _randomise(mlp, g)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            mlp.to(dtype)
            for shape in ((3, 5), (1, 1)):
                h = (torch.randn(*shape, 2 * 72, generator=g) * 1.5).to(dtype)
                gate, up = h.chunk(2, dim=-1)
                agree(gat.gated_act_triton(h, act), mlp.act_fn(gate) * up, (family, dtype, shape))
        # columns across programs (BLOCK 16 < 72 = I, the last one partial)
        gat.BLOCK, block = 16, gat.BLOCK
        try:
            h = torch.randn(4, 2 * 72, generator=g).bfloat16()
            gate, up = h.chunk(2, dim=-1)
            agree(gat.gated_act_triton(h, act), mlp.act_fn(gate) * up, (family, "blocks"))
        finally:
            gat.BLOCK = block
        # the stand-ins against the modules they replace
        mlp.float()
        fused = FusedGatedMLP.of(mlp, kernels=True)
        assert fused.act == act, fused.act
        x = torch.randn(2, 3, mlp.gate_proj.in_features, generator=g)
        with torch.no_grad():
            agree(fused(x), mlp(x), (family, "FusedGatedMLP"))
        for dtype in (torch.float32, torch.bfloat16):
            norm = model.model.layers[1].post_attention_layernorm.to(dtype)
            _randomise(norm, g, 1.0 if family == "llama" else 0.0)
            stand_in = FusedRMSNorm.of(norm)
            assert stand_in is not None and stand_in.offset == (family == "gemma")
            x = torch.randn(2, 3, norm.weight.shape[0], generator=g).to(dtype)
            with torch.no_grad():  # inference: under autograd the stand-in runs the module itself
                agree(stand_in(x), norm(x), (family, dtype, "FusedRMSNorm"))


class _Launches:
    """Counts PyTorch operators (aten calls) and our kernels' launches, one each; what the interpreter runs
    inside a launch is not counted."""

    n, inside = 0, False

    @classmethod
    def launch(cls, kernel, name, calls):
        def run(*args, **kwargs):
            calls[name] += 1
            cls.n += 1
            cls.inside, was = True, cls.inside
            try:
                return kernel(*args, **kwargs)
            finally:
                cls.inside = was

        return run


def _launches_per_step(decoder, ids, mask):
    """Launches of one decode step (eager on the CPU): two runs of different lengths, differenced."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not _Launches.inside:
                _Launches.n += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for new in (3, 7):
        _Launches.n = 0
        with Count():
            decoder.generate(ids, mask, max_new_tokens=new)
        counts.append(_Launches.n)
    return (counts[1] - counts[0]) / 4


def check_decoder():
    import linearize
    from linearize.convert import mixers
    from linearize.decode import fused as decode_fused
    from linearize.decode.route import plain_loop
    from linearize.fast import FastDecoder

    calls = {"norm": 0, "add": 0, "act": 0}
    rnt.rms_norm_triton = _Launches.launch(rnt.rms_norm_triton, "norm", calls)
    rnt.add_rms_norm_triton = _Launches.launch(rnt.add_rms_norm_triton, "add", calls)
    gat.gated_act_triton = _Launches.launch(gat.gated_act_triton, "act", calls)
    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    ids = ids.masked_fill(mask == 0, 0)
    spec = {"kind": "lolcats", "window": 4, "feature_dim": 8}
    # Llama (SiLU); Qwen3's per-head q/k norms inside the converted layers; Gemma's (1 + weight) norms and GELU;
    # a kept softmax layer; SUPRA. Two layers each (every layer's norms and MLP run alike), the second one kept
    for family, s in (("llama", spec), ("qwen3", spec), ("gemma", spec), ("llama", {**spec, "keep_softmax": [1]}),
                      ("llama", {"kind": "supra"})):
        model = linearize.convert(_family(family, num_hidden_layers=2), s)
        model.generation_config.eos_token_id = None
        n_norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
        paired = 0 if family == "gemma" else len(model.model.layers)  # pre-norm layers: adds with their norms
        with decode_fused.fused_projections(model, kernels=True) as n:
            assert n == n_norms + len(mixers(model)) + len(model.model.layers) + paired, (family, n)
        plain = FastDecoder(model, fuse_kernels=False).generate(ids, mask, max_new_tokens=6)
        calls.update(norm=0, add=0, act=0)
        fused = FastDecoder(model, fuse_kernels=True).generate(ids, mask, max_new_tokens=6)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                             **plain_loop(model))  # transformers' own loop
        assert torch.equal(fused, plain) and torch.equal(fused, ref), (family, s)
        # every norm and MLP on every forward: the prefill and 5 steps (past the ring of 4); in a pre-norm layer
        # both adds with the norm after them (the second layer's input norm, the final norm)
        assert calls == {"norm": 6 * (n_norms - 2 * paired), "add": 6 * 2 * paired,
                         "act": 6 * len(model.model.layers)}, (family, calls, n_norms)
        assert not any(type(m).__name__.startswith("Fused") for m in model.modules()), family  # all restored
    # the kernels cut a decode step's launches: 5 a norm in fp32 (2 a layer + the final one; 7 in 16 bits), 1 an MLP,
    # and each residual add goes into the norm after it
    model = linearize.convert(_family("llama", num_hidden_layers=2), spec)
    model.generation_config.eos_token_id = None
    before = _launches_per_step(FastDecoder(model, fuse_kernels=False), ids, mask)
    after = _launches_per_step(FastDecoder(model, fuse_kernels=True), ids, mask)
    layers = len(model.model.layers)
    assert before - after >= 5 * (2 * layers + 1) + layers + 2 * layers, (before, after)
    print(f"launches per step, 2-layer Llama LoLCATs on the CPU: {before:.0f} -> {after:.0f}", file=sys.stderr)


parts = sys.argv[1:] or ["norm", "add_norm", "act", "decoder"]
for part in parts:
    {"norm": check_norm, "add_norm": check_add_norm, "act": check_act, "decoder": check_decoder}[part]()
print("ok")
