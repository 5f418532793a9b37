"""Run by test_ops.py / test_fast.py in a subprocess, on the CPU through Triton's interpreter: the
fused LoLCATs decode step (RoPE, Hedgehog maps, window, linear state, bookkeeping in one kernel).

``kernel``: against the PyTorch ring step after RoPE and the feature maps, token after token.
``decoder``: the fast decoder with the fused step against the fast decoder without it.
``length``: the same for the length options (gated linear state, features before RoPE), whose step
without the fused kernel is the PyTorch ring step; and the kernel given a gate's projection and bias
(read in place from the fused q/k/v product) against the same kernel given the log gates."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from helpers import fused_hybrid_steps, fused_sink_steps  # noqa: E402
from linearize.mixers.feature_maps import Hedgehog  # noqa: E402
from linearize.ops.hybrid import step_triton  # noqa: E402

torch.set_grad_enabled(False)


def _inputs(b, h, hk, d, fh, t, n, rot, seed):
    """Hedgehog maps, strided q/k/v (as the adapter splits one projection's output), RoPE's cos and sin
    over the first ``rot`` dims (None when 0), and the generator's draw function, for ``t + n`` tokens."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    fq, fk = Hedgehog(h, d, fh), Hedgehog(hk, d, fh)
    fq.weight.copy_(r(h, d, fh) * 0.5)
    fk.weight.copy_(r(hk, d, fh) * 0.5)
    q, k, v = (x.transpose(1, 2) for x in r(b, t + n, h + 2 * hk, d).split([h, hk, hk], dim=2))
    angles = r(b, t + n, rot // 2) * 3
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return fq, fk, q, k, v, cos if rot else None, sin, r


def check_kernel(b, h, hk, d, fh, window, t, n, softcap, rot, splits, seed):
    fq, fk, q, k, v, cos, sin, r = _inputs(b, h, hk, d, fh, t, n, rot, seed)
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[-1, : t // 2] = False  # left padding: empty slots in the last sequence's ring
    *steps, (mine, ref) = fused_hybrid_steps(q, k, v, cos, sin, fq, fk, r(h), key_mask, window=window,
                                             t=t, n=n, softcap=softcap, splits=splits)
    for i, (got, want) in enumerate(steps):
        assert got.shape == want.shape and got.transpose(1, 2).is_contiguous()
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (i, (got - want).abs().max())
    assert torch.equal(mine.ticks, torch.full_like(mine.ticks, n % (2 * window)))  # from_state starts at slot 0
    for a, e in zip(mine.ring().tensors(), ref.tensors()):
        assert torch.equal(a, e) if a.dtype in (torch.bool, torch.long) else torch.allclose(a, e, atol=1e-5), a.dtype


def check_sinks(b, h, hk, d, fh, window, cap, t, n, softcap, rot, splits, anchor, seed):
    """A cache of the first ``cap`` tokens (attention sinks), full after the prefill: the fused step on a
    ``FusedSinkState`` against the sparse cache's PyTorch ring step (``RingSparseState``)."""
    fq, fk, q, k, v, cos, sin, r = _inputs(b, h, hk, d, fh, t, n, rot, seed)
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[-1, : t - window - cap - 1] = False  # left padding; every sequence's first tokens have left the window
    *steps, (mine, ref) = fused_sink_steps(q, k, v, cos, sin, fq, fk, r(h) * 2, key_mask,
                                           window=window, cap=cap, t=t, n=n, softcap=softcap, splits=splits,
                                           anchor=anchor)
    for i, (got, want) in enumerate(steps):
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (i, anchor, (got - want).abs().max())
    assert torch.equal(mine.sink_keys, ref.cache_keys) and torch.equal(mine.sink_valid, ref.cache_valid)
    assert torch.allclose(mine.ring().linear, ref.linear, atol=1e-5)


def check_gate_input(b=2, h=4, hk=2, d=8, fh=6, window=4, t=6, n=5, splits=2, seed=7):
    """``gate_input`` / ``gate_bias`` (a strided slice, as of the fused product) against ``log_gate`` =
    -softplus(input + bias) computed first: the same outputs, token after token, and the same state."""
    import torch.nn.functional as F
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    from linearize import ops

    fq, fk, q, k, v, cos, sin, r = _inputs(b, h, hk, d, fh, t, n, 8, seed)
    logit, bias = r(h), r(hk)
    products = r(b, t + n, 5 + hk) * 3  # the gate's columns at the end of a wider product
    log_gates = -F.softplus(products[..., 5:] + bias).transpose(1, 2)
    rq, rk = apply_rotary_pos_emb(q, k, cos, sin)
    pre, kw = slice(0, t), dict(scale=d ** -0.5, softcap=None)
    _, state = ops.hybrid_attention_chunked(rq[:, :, pre], rk[:, :, pre], fq(rq[:, :, pre]), fk(rk[:, :, pre]),
                                            v[:, :, pre], torch.sigmoid(logit), window=window, **kw,
                                            log_gate=log_gates[..., pre], output_final_state=True)
    ring = ops.RingHybridState.from_state(state, window, keep_key_features=False)
    given, taken = (ops.FusedRingState.from_ring(ring.map(lambda x: x.clone()), fk, h, splits, gated=True)
                    for _ in range(2))
    for i in range(t, t + n):
        sl = slice(i, i + 1)
        args = (q[:, :, sl], k[:, :, sl], v[:, :, sl], (cos[:, sl], sin[:, sl]), fq.weight, fk.weight, logit)
        want = step_triton.hybrid_step_fused_triton(*args, given, **kw, log_gate=log_gates[..., sl])
        got = step_triton.hybrid_step_fused_triton(*args, taken, **kw, gate_input=products[:, sl, 5:], gate_bias=bias)
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (i, (got - want).abs().max())
    assert torch.allclose(taken.linear, given.linear, atol=1e-6, rtol=1e-5)
    assert torch.equal(taken.ticks, given.ticks) and torch.equal(taken.keys, given.keys)


def _teacher(family):
    """A tiny random teacher of two layers (SmolLM3's second without RoPE): the decoder-level checks run
    every layer's step alike, so two layers (one feeding the other) show what three did."""
    from transformers import AutoModelForCausalLM

    from helpers import tiny_config

    torch.manual_seed(0)
    extra = {"no_rope_layers": [1, 0]} if family == "smollm3" else {}
    return AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=2, **extra)).eval()


def check_decoder():
    import linearize
    from linearize.fast import FastDecoder
    from linearize.mixers.lolcats import LolcatsAttention

    calls, on_cuda = [], LolcatsAttention.fused_decoding
    fused_step = step_triton.hybrid_step_fused_triton
    step_triton.hybrid_step_fused_triton = lambda *a, **kw: calls.append(1) or fused_step(*a, **kw)
    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding: an empty slot in the ring
    # GQA; soft-capping (partial RoPE and a layer without RoPE take the same step: with the length options in
    # ``check_length_options``, and in the kernel's own checks). 6 new tokens: 5 fused steps, past the ring of 4
    for family in ("llama", "gemma2"):
        model = linearize.convert(_teacher(family), {"kind": "lolcats", "window": 4, "feature_dim": 8})
        model.generation_config.eos_token_id = None
        plain = FastDecoder(model).generate(ids, mask, max_new_tokens=6)
        LolcatsAttention.fused_decoding = lambda self: True  # as on CUDA
        fused = FastDecoder(model).generate(ids, mask, max_new_tokens=6)
        LolcatsAttention.fused_decoding = on_cuda
        assert calls and torch.equal(fused, plain), family
        calls.clear()
    # attention sinks (a cache of the first 2 tokens): the fused step once every sequence's are cached (9 real
    # tokens, window 4), the sparse cache's own step before (4 real tokens: none has left the window)
    ids = torch.randint(2, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    for anchor, real, fused_step_runs in (("joint", 9, True), ("window", 9, True), ("joint", 4, False)):
        model = linearize.convert(_teacher("llama"), {"kind": "lolcats", "window": 4, "feature_dim": 8,
                                                      "sparse_cache": 2, "sparse_priority": "first",
                                                      "sparse_anchor": anchor})
        model.generation_config.eos_token_id = None
        mask = torch.ones_like(ids)
        mask[1, : 12 - real] = 0
        plain = FastDecoder(model).generate(ids, mask, max_new_tokens=6)
        LolcatsAttention.fused_decoding = lambda self: True  # as on CUDA
        fused = FastDecoder(model).generate(ids, mask, max_new_tokens=6)
        LolcatsAttention.fused_decoding = on_cuda
        assert bool(calls) == fused_step_runs and torch.equal(fused, plain), (anchor, real)
        calls.clear()


def check_length_options():
    import linearize
    from linearize.convert import mixers
    from linearize.fast import FastDecoder
    from linearize.mixers.lolcats import LolcatsAttention

    calls, on_cuda = [], LolcatsAttention.fused_decoding
    fused_step = step_triton.hybrid_step_fused_triton
    step_triton.hybrid_step_fused_triton = lambda *a, **kw: calls.append(1) or fused_step(*a, **kw)
    ids = torch.randint(2, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding: empty slots in the ring
    # each option alone on Llama: the data-dependent gate (read by the kernel before its activation), features
    # before RoPE, the learned span (log gates given); both options on soft-capping, partial RoPE and SmolLM3
    # (a layer with RoPE over every dim as Llama's, one without: Llama with both needs no run of its own)
    both = {"feature_rope": False, "decay": "gated"}
    options = [("llama", {"decay": "gated"}), ("llama", {"feature_rope": False}), ("llama", {"decay": "span"})]
    for family, option in options + [(f, both) for f in ("gemma2", "gpt_neox", "smollm3")]:
        model = linearize.convert(_teacher(family), {"kind": "lolcats", "window": 4, "feature_dim": 8,
                                                     "decay_horizon": 6, **option})
        gen = torch.Generator().manual_seed(1)
        for m in mixers(model).values():  # gates that differ per token and head
            if hasattr(m, "gate_proj"):
                m.gate_proj.weight.copy_(torch.randn(m.gate_proj.weight.shape, generator=gen))
        model.generation_config.eos_token_id = None
        plain = FastDecoder(model).generate(ids, mask, max_new_tokens=6)  # 5 fused steps: past the ring of 4
        LolcatsAttention.fused_decoding = lambda self: True  # as on CUDA
        fused = FastDecoder(model).generate(ids, mask, max_new_tokens=6)
        LolcatsAttention.fused_decoding = on_cuda
        assert calls and torch.equal(fused, plain), (family, option, fused, plain)
        calls.clear()


if sys.argv[1:] == ["length"]:
    check_gate_input()
    step_triton.STEP_CHUNK, step_triton.CHUNK_PROGRAMS = 4, 0  # four value columns at a time, however few programs
    check_length_options()
elif sys.argv[1:] == ["kernel"]:
    # the ring wraps in every case (n > window); in the first one the ticks too (n > 2 x window)
    check_kernel(2, 4, 2, 8, 6, window=4, t=6, n=11, softcap=None, rot=8, splits=1, seed=0)  # GQA, wraps twice
    check_kernel(2, 3, 1, 16, 8, window=4, t=3, n=6, softcap=20.0, rot=8, splits=2, seed=1)  # MQA, partial RoPE
    check_kernel(2, 4, 2, 12, 5, window=5, t=9, n=6, softcap=None, rot=12, splits=2, seed=2)  # odd sizes
    check_kernel(1, 4, 2, 16, 4, window=1, t=4, n=4, softcap=None, rot=0, splits=4, seed=3)  # w = 1, no RoPE
    # attention sinks, each anchor twice (its branch is apart from the rest of the kernel): GQA with RoPE over
    # every dim and two sequences (joint), odd sizes with soft-capping and partial RoPE (both), MQA without RoPE
    # (window)
    check_sinks(2, 4, 2, 8, 6, window=4, cap=2, t=11, n=6, softcap=None, rot=8, splits=1, anchor="joint", seed=4)
    for anchor in ("joint", "window"):
        check_sinks(1, 4, 2, 12, 5, window=5, cap=3, t=13, n=7, softcap=20.0, rot=8, splits=2, anchor=anchor, seed=5)
    check_sinks(1, 3, 1, 16, 4, window=2, cap=4, t=9, n=6, softcap=None, rot=0, splits=4, anchor="window", seed=6)
    step_triton.STEP_CHUNK, step_triton.CHUNK_PROGRAMS = 2, 0  # two value columns at a time, however few programs
    check_kernel(2, 4, 2, 12, 5, window=5, t=9, n=6, softcap=None, rot=12, splits=1, seed=7)
    check_sinks(1, 4, 2, 12, 5, window=5, cap=3, t=13, n=7, softcap=20.0, rot=8, splits=2, anchor="window", seed=8)
else:
    check_decoder()
print("ok")
