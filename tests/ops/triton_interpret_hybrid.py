"""Run by test_ops.py in a subprocess: the fused Triton hybrid decode step against the PyTorch ring
step, token after token, on the CPU through Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from linearize import ops  # noqa: E402
from linearize.ops.hybrid.step_triton import hybrid_step_ring_triton  # noqa: E402


def check(b, h, hk, d, f, window, t, n, softcap, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    w_feat = r(d, f)
    fmap = lambda x: torch.softmax(x @ w_feat, dim=-1)  # noqa: E731
    q, k, v = r(b, h, t + n, d), r(b, hk, t + n, d), r(b, hk, t + n, d)
    xs = [q, k, torch.softmax(r(b, h, t + n, f), -1), fmap(k), v]
    gamma = torch.sigmoid(r(h))
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[-1, : t // 2] = False
    kw = dict(scale=d ** -0.5, softcap=softcap)
    _, state = ops.hybrid_attention_chunked(*(x[:, :, :t] for x in xs), gamma, window=window, **kw,
                                            output_final_state=True, key_mask=key_mask)
    ref = ops.RingHybridState.from_state(state, window, keep_key_features=False)
    mine = ref.map(lambda x: x.clone())
    for i in range(t, t + n):
        qq, kk, qf, _, vv = (x[:, :, i : i + 1] for x in xs)
        want, ref = ops.hybrid_attention_step_ring(qq, kk, qf, None, vv, gamma, ref, **kw, key_feature_map=fmap)
        old = fmap(mine.keys.index_select(2, mine.slot.view(1)))
        got = hybrid_step_ring_triton(qq, kk, qf, vv, gamma, old, mine, **kw)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (i, (got - want).abs().max())
    for a, e in zip(mine.tensors(), ref.tensors()):
        assert torch.equal(a, e) if a.dtype in (torch.bool, torch.long) else torch.allclose(a, e, atol=1e-5), a.dtype


check(2, 6, 2, 8, 12, window=4, t=6, n=9, softcap=None, seed=0)  # GQA, the ring wraps twice, left padding
check(1, 4, 4, 16, 16, window=8, t=3, n=10, softcap=20.0, seed=1)  # prompt shorter than the window, soft-capping
check(2, 3, 1, 5, 7, window=5, t=12, n=7, softcap=None, seed=2)  # MQA, odd sizes (masked tiles)
print("ok")
