"""Run by test_xatl_ops.py in a subprocess: the fused Triton causal conv1d + SiLU (forward and backward)
against the float64 PyTorch form, and StripedMamba with it against its PyTorch path, on the CPU through
Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
import linearize.ops.causal_conv1d_triton as cct  # noqa: E402
from linearize.ops.selective_scan import causal_conv1d_naive  # noqa: E402

PRODUCTION_BLOCKS = (cct.BLOCK_T, cct.BLOCK_D, cct.BWD_BLOCK_T, cct.BWD_BLOCK_D)


def reference(x, w, bias, initial_state=None, output_final_state=False):
    """``F.silu(causal_conv1d_naive(...))`` in channels-last terms, and the last K - 1 inputs."""
    k = w.shape[-1]
    y = F.silu(causal_conv1d_naive(x.transpose(1, 2), w, bias, initial_state=initial_state)).transpose(1, 2)
    if not output_final_state:
        return y, None
    past = initial_state if initial_state is not None else x.new_zeros(x.shape[0], x.shape[2], k - 1)
    return y, torch.cat([past, x.transpose(1, 2)], dim=-1)[..., -(k - 1):]


def check(b, t, dn, k, with_bias, with_state, final, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    # x as the mixer passes it: a column slice of the wider input projection (token stride 3 * Dn here)
    x = r(b, t, 3 * dn)[..., dn : 2 * dn] if strided else r(b, t, dn)
    ins = [x, r(dn, 1, k) * 0.7, r(dn) if with_bias else None, r(b, dn, k - 1) if with_state else None]
    w_y, w_h = r(b, t, dn), r(b, dn, k - 1)
    names = ["dx", "dweight", "dbias", "dstate"]
    case = (b, t, dn, k, with_bias, with_state, final, strided, cct.BLOCK_T, cct.BLOCK_D, cct.BWD_BLOCK_T,
            cct.BWD_BLOCK_D)

    def run(fn, xs):
        xs = [v.requires_grad_(True) if v is not None else None for v in xs]
        y, h = fn(*xs, output_final_state=final)
        assert (h is None) == (not final), case
        loss = (y.double() * w_y).sum() + ((h.double() * w_h).sum() if final else 0.0)
        live = [(n, v) for n, v in zip(names, xs) if v is not None]
        grads = torch.autograd.grad(loss, [v for _, v in live])
        return [("y", y), *([("final state", h)] if final else []), *zip([n for n, _ in live], grads)]

    want = run(reference, [v.detach().clone() if v is not None else None for v in ins])
    got = run(cct.causal_conv1d_silu_triton, [v.detach().float() if v is not None else None for v in ins])
    assert [n for n, _ in got] == [n for n, _ in want], case
    for (name, a), (_, e) in zip(got, want):
        assert a.shape == e.shape, (name, a.shape, e.shape, case)
        assert a.dtype == torch.float32, (name, a.dtype, case)
        rel = ((a.double() - e).norm() / e.norm()).item()
        assert rel < 1e-5, (name, rel, case)
    assert got[0][1].is_contiguous(), case


def final_state_only():
    """Only the final state is used: y gets no gradient, the inputs still get the state's."""
    g = torch.Generator().manual_seed(11)
    x, w, s0 = torch.randn(2, 5, 6, generator=g), torch.randn(6, 1, 4, generator=g), torch.randn(2, 6, 3, generator=g)
    for t in (5, 2):
        xs = [x[:, :t].clone().requires_grad_(True), w.clone().requires_grad_(True), s0.clone().requires_grad_(True)]
        _, h = cct.causal_conv1d_silu_triton(xs[0], xs[1], None, initial_state=xs[2], output_final_state=True)
        dx, dw, ds = torch.autograd.grad(h.sum(), xs)
        want_dx = torch.zeros_like(xs[0])
        want_dx[:, max(0, t - 3):] = 1
        want_ds = torch.zeros_like(s0)
        want_ds[:, :, t:] = 1
        assert torch.equal(dx, want_dx) and torch.equal(ds, want_ds) and torch.equal(dw, torch.zeros_like(w)), t


def mixer_fused_equals_pytorch():
    """StripedMamba's ``conv_silu`` forced onto the fused op against its PyTorch branch: the logits and
    every parameter gradient of a tiny float32 model (padding-free, so the fused branch applies)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    from linearize.mixers import mamba
    from linearize.convert.xatl_transfer import build_xatl

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama", initializer_range=0.2)).float().eval()
    student, _ = build_xatl(teacher, "striped_mamba", seed=0, chunk_size=8)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    w = torch.randn(2, 21, 97, generator=torch.Generator().manual_seed(1))
    params = [p for p in student.parameters() if p.requires_grad]
    calls = []
    orig = mamba.conv_silu
    out = {}
    for fused in (True, False):
        def conv_silu(*a, fused_=fused, **kw):
            calls.append(fused_)
            return orig(*a, **{**kw, "fused": fused_})

        mamba.conv_silu = conv_silu
        try:
            logits = student(ids, use_cache=False).logits
        finally:
            mamba.conv_silu = orig
        grads = torch.autograd.grad((logits * w).sum(), params, allow_unused=True)
        out[fused] = [("logits", logits), *((n, gr) for (n, _), gr in zip(student.named_parameters(), grads)
                                            if gr is not None)]
    n_mixers = sum(isinstance(m, mamba.MambaMixer) for m in student.modules())
    assert n_mixers > 0 and calls == [True] * n_mixers + [False] * n_mixers, calls
    assert [n for n, _ in out[True]] == [n for n, _ in out[False]]
    assert any("conv1d" in n for n, _ in out[True])
    for (name, a), (_, e) in zip(out[True], out[False]):
        rel = ((a.double() - e.double()).norm() / e.double().norm()).item()
        assert rel < 1e-5, (name, rel)


def blocks(bt, bd, bwd_bt=None, bwd_bd=None):
    """The forward's token and channel blocks, and the backward's (the same unless given)."""
    cct.BLOCK_T, cct.BLOCK_D = bt, bd
    cct.BWD_BLOCK_T, cct.BWD_BLOCK_D = bwd_bt or bt, bwd_bd or bd


# tiny blocks, so that short sequences and narrow layers span several programs each way
blocks(8, 16)
check(2, 3 * 8 + 5, 16 + 5, 4, True, True, True, 0)  # T off the token block, Dn off the channel block
check(1, 2 * 8, 32, 4, False, False, True, 1)  # T and Dn on the blocks, no bias, zero state
check(2, 2, 7, 4, True, True, True, 2)  # T < K - 1: the final state keeps part of the initial one
check(3, 1, 9, 4, True, True, True, 3)  # T = 1
check(1, 1, 5, 4, False, False, True, 4)  # T = 1 from zeros
check(2, 19, 20, 4, True, True, False, 5)  # no final state
check(2, 19, 20, 4, True, False, False, 6)  # neither state
check(2, 21, 19, 4, True, True, True, 7, strided=True)  # x a column slice of a wider tensor
check(2, 13, 18, 3, True, True, True, 8)  # K = 3
check(1, 2, 18, 3, False, True, True, 9, strided=True)  # K = 3, T = K - 1
check(2, 11, 6, 2, True, True, True, 10)  # K = 2 (a one-token state)
blocks(8, 16, 16, 8)  # the backward on other blocks than the forward
check(2, 3 * 8 + 5, 16 + 5, 4, True, True, True, 11)
final_state_only()
blocks(16, 32)  # the model: 21 tokens and 96 channels still span 2 x 3 blocks
mixer_fused_equals_pytorch()
# the production blocks once
blocks(*PRODUCTION_BLOCKS)
check(1, 64 + 9, 64 + 3, 4, True, True, True, 12, strided=True)
print("ok")
