"""Run by test_hybrid_prelude_triton.py in a subprocess, on the CPU through Triton's interpreter: the
fused prelude of the hybrid's backward (``ops/hybrid/prelude_triton.py``, RoPE + Hedgehog maps forward
and backward) against ``rope_half`` + ``hedgehog_features`` + autograd in float64, and the hybrid's
whole backward with ``FUSED_PRELUDE`` on against off.

bf16 is not checked here: Triton's interpreter multiplies bf16 tiles wrongly (fp16 stands in for the
half-precision products; the CUDA tests of ``test_gpu_hybrid.py`` run bf16 through the switch).
``ARGS`` picks the cases (all by default)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from linearize.ops.hybrid import chunk_triton as kernels  # noqa: E402
from linearize.ops.hybrid import prelude_triton as prelude  # noqa: E402
from linearize.ops.hybrid.chunk_triton import hedgehog_features, hybrid_triton, rope_half  # noqa: E402

TOLS = {torch.float32: 2e-6, torch.float16: 3e-3}  # fp32: ~2e-7 seen; fp16: ~7e-4


def _close(got, want, what, tol, floor=1e-6):
    """Largest error relative to the largest reference entry (at least ``floor``)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = ((got.double() - want).abs().max() / want.abs().max().clamp_min(floor)).item()
    assert err < tol, (what, err)


def _rope(b, t, r, g):
    if not r:
        return None, None
    angles = torch.randn(b, t, r // 2, generator=g, dtype=torch.float64) * 3
    angles = torch.cat([angles, angles * 0.7], -1)  # the halves' angles differ: cos/sin read at the right dims
    return angles.cos(), angles.sin()


def check(b, h, t, d, fh, r, shared, seed, dtype=torch.float32, cos_batch=False, strided=True, drot=True,
          need_dx=True, need_dw=True, programs=None, nope=False):
    """``nope``: the features of x before RoPE (``feature_rope: false``), its rotation still returned."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    # x as a strided view of a [B, T, heads, D] projection, as the adapters give q and k
    x = rn(b, t, h + 1, d)[:, :, 1:].transpose(1, 2) if strided else rn(b, h, t, d)
    x = x.to(dtype).double()  # the reference from the input as rounded
    w = rn(1 if shared else h, d, fh) * 0.5
    cos, sin = _rope(b if cos_batch else 1, t, r, g)
    d_rot = rn(b, h, t, d) if drot else None
    d_feat = rn(b, h, t, 2 * fh)
    tol = TOLS[dtype]

    # the reference: rope_half + hedgehog_features + autograd in float64
    rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
    xr = rope_half(rx, cos, sin) if r else rx
    feat = hedgehog_features(rx if nope else xr, rw)
    outs, grads = [feat], [d_feat]
    if drot:
        outs, grads = [feat, xr], [d_feat, d_rot]
    want_dx, want_dw = torch.autograd.grad(outs, [rx, rw], grads)

    mx, mw = x.to(dtype), w.float()
    mcos, msin = (None, None) if not r else (cos.float(), sin.float())
    got_xr, got_feat = prelude.hedgehog_rope_forward(mx, mcos, msin, mw, nope=nope)
    assert got_xr.dtype == got_feat.dtype == dtype
    _close(got_xr, xr.detach(), "xr", tol)
    if not r:
        assert got_xr is mx
    _close(got_feat, feat.detach(), "features", tol)

    saved = prelude.PRELUDE_PROGRAMS, prelude.WIDE
    if programs is not None:  # fewer programs: each sums several tiles (and some tiles past the end)
        prelude.PRELUDE_PROGRAMS = programs
        prelude.WIDE = {k: v for k, v in prelude.WIDE.items() if k != "PRELUDE_PROGRAMS"}
    try:
        dx, dw = prelude.hedgehog_rope_backward(mx, mcos, msin, mw, None if d_rot is None else d_rot.float(),
                                                d_feat.float(), need_dx=need_dx, need_dw=need_dw, nope=nope)
    finally:
        prelude.PRELUDE_PROGRAMS, prelude.WIDE = saved
    if need_dx:
        assert dx.dtype == dtype and dx.shape == x.shape
        _close(dx, want_dx, "dx", tol)
    else:
        assert dx is None
    if need_dw:
        assert dw.dtype == torch.float32 and dw.shape == w.shape
        _close(dw, want_dw, "dw", tol)
    else:
        assert dw is None


def check_switch(dtype=torch.float32, rot=8, shared=False, weights_only=False, checkpointed=False):
    """The hybrid's backward with the fused prelude equals the PyTorch prelude's: gradients of q, k,
    v, gamma (logits), wq and wk (or the weights' alone); GQA, RoPE over every dim, part of them or
    none, left padding. ``checkpointed``: the fused one inside a non-reentrant checkpoint (a layer of
    --gradient-checkpointing), whose saved tensors unpack only once."""
    b, h, hk, t, d, fh, window = 2, 4, 2, 13, 8, 5, 8  # 2 chunks, the last one partial
    g = torch.Generator().manual_seed(20)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    qkv = rn(b, t, h + 2 * hk, d)
    q, k, v = (x.transpose(1, 2) for x in qkv.to(dtype).split([h, hk, hk], dim=2))
    wq, wk = rn(1 if shared else h, d, fh).float() * 0.5, rn(1 if shared else hk, d, fh).float() * 0.5
    rope = None
    if rot:
        angles = rn(1, t, rot // 2) * 3
        rope = (torch.cat([angles, angles], -1).cos().float(), torch.cat([angles, angles], -1).sin().float())
    gamma = rn(h).float()
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[-1, :3] = False
    wy = rn(b, h, t, d) * key_mask[:, None, :, None]

    def grads(fused, recomputed=False):
        kernels.FUSED_PRELUDE = fused
        try:
            mine = [x.detach().requires_grad_(not weights_only or i >= 4)
                    for i, x in enumerate((q, k, v, gamma, wq, wk))]

            def run(*xs):
                return hybrid_triton(*xs[:4], window=window, scale=d ** -0.5, key_mask=key_mask,
                                     hedgehog=tuple(xs[4:]), rope=rope, logit=True)[0]

            y = torch.utils.checkpoint.checkpoint(run, *mine, use_reentrant=False) if recomputed else run(*mine)
            wanted = [x for x in mine if x.requires_grad]
            return torch.autograd.grad((y.double() * wy).sum(), wanted)
        finally:
            kernels.FUSED_PRELUDE = True

    names = ("wq", "wk") if weights_only else ("q", "k", "v", "gamma", "wq", "wk")
    tol = {torch.float32: 2e-5, torch.float16: 5e-3}[dtype]
    for name, a, e in zip(names, grads(True, checkpointed), grads(False)):
        assert a.dtype == e.dtype, (name, a.dtype, e.dtype)
        _close(a, e.double(), "d" + name + " (fused against PyTorch prelude)", tol,
               floor=1.0 if name == "gamma" else 1e-6)


CASES = {
    # (b, h, t, d, fh, r, shared, seed)
    "full": lambda: check(2, 3, 37, 8, 5, 8, False, 0),  # RoPE over every dim, per-head weights, T off the tile
    "partial": lambda: check(1, 2, 45, 8, 6, 4, True, 1, cos_batch=True),  # R < D, shared weights, cos per sequence
    "norope": lambda: check(2, 2, 19, 6, 4, 0, False, 2),  # no rotation, D and F/2 off the powers of two
    "nodrot": lambda: check(1, 3, 33, 8, 5, 6, False, 3, drot=False, strided=False),  # features' gradient alone
    "weights": lambda: check(1, 2, 40, 8, 5, 8, True, 4, need_dx=False),  # dW only (LoLCATs stage 1)
    "dx_only": lambda: check(1, 2, 40, 8, 5, 8, False, 5, need_dw=False),
    "steps": lambda: check(1, 2, 150, 8, 5, 4, False, 6, programs=4),  # several tiles a program, a tile past T
    "half": lambda: check(2, 2, 37, 16, 8, 8, False, 7, dtype=torch.float16),
    "half_shared": lambda: check(1, 3, 50, 16, 8, 12, True, 8, dtype=torch.float16, programs=3),
    "half_tiles": lambda: check(1, 2, 300, 16, 8, 8, False, 9, dtype=torch.float16),  # 16-bit tiles, T over several
    # features before RoPE: every dim rotated, part of them (cos per sequence), fp16, the weights' gradient alone
    "nope": lambda: check(2, 3, 37, 8, 5, 8, False, 10, nope=True),
    "nope_partial": lambda: check(1, 2, 45, 8, 6, 4, True, 11, cos_batch=True, nope=True, programs=3),
    "nope_half": lambda: check(2, 2, 37, 16, 8, 8, False, 12, dtype=torch.float16, nope=True),
    "nope_weights": lambda: check(1, 2, 40, 8, 5, 8, True, 13, need_dx=False, nope=True),
    "switch": check_switch,
    "switch_shared_norope": lambda: check_switch(rot=0, shared=True),
    "switch_weights": lambda: check_switch(rot=4, weights_only=True),
    "switch_half": lambda: check_switch(torch.float16),
    "switch_checkpointed": lambda: check_switch(checkpointed=True),
}

for name in sys.argv[1:] or CASES:
    CASES[name]()
print("ok")
