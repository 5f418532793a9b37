"""Run by test_delta.py in a subprocess, on the CPU through Triton's interpreter: the delta hybrid's fused
ring step (``ops/delta/step_triton.py``).

``kernel``: against RoPE, the unit feature maps and the gates in PyTorch followed by the PyTorch ring step
(``delta_window_step_ring``), token after token from a prefill's state: outputs and every buffer of the state
(GQA, soft-capping, partial RoPE and none, features before and after RoPE, strided q/k/v and gate inputs, a
window the prompt does not fill, left padding, bf16 buffers).
``decoder``: the fast decoder of a delta student with the fused step against the same decoder without it."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from linearize import ops  # noqa: E402
from linearize.models.base import rope_rotate_half  # noqa: E402
from linearize.ops.delta.step_triton import delta_step_fused_triton  # noqa: E402

torch.set_grad_enabled(False)


def _reference_inputs(q, k, cos, sin, wq, wk, xa, xb, xl, dt, a_log, mix_bias, feature_rope):
    """What the mixer's PyTorch path computes before the ring step (fp32)."""
    qr, kr = (q, k) if cos is None else (rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin))
    qs, ks = (qr, kr) if feature_rope else (q, k)
    qd, kd = F.normalize(qs.float() @ wq, dim=-1), F.normalize(ks.float() @ wk, dim=-1)
    g = (-a_log.exp() * F.softplus(xa.float() + dt)).transpose(1, 2)
    beta = torch.sigmoid(xb.float()).transpose(1, 2)
    lam = torch.sigmoid(xl.float() + mix_bias).transpose(1, 2)
    return qr, kr, qd, kd, g, beta, lam


def _same_state(fused, ring, tol, where):
    """A ``FusedRingDeltaState`` holds what a ``RingDeltaState`` does, its bookkeeping once per key head."""
    for a, c in zip(fused.tensors()[:5] + (fused.memory,), ring.tensors()[:5] + (ring.memory,)):
        assert (a.float() - c.float()).abs().max().item() < tol, where
    hk = fused.keys.shape[1]
    assert torch.equal(fused.valid, ring.valid[:, None].expand(-1, hk, -1)), where
    assert torch.equal(fused.written, ring.written[:, None].expand(-1, hk)), where
    assert torch.equal(fused.ticks, ring.slot.expand_as(fused.ticks)), where


def check_kernel():
    b, h, hk, d = 2, 4, 2, 16
    cases = ((4, 7, 3, None, 16, False, torch.float32), (4, 2, 1, 2.0, 8, True, torch.float32),
             (3, 6, 0, None, 0, False, torch.bfloat16))
    for window, prompt, pad, softcap, rot, feature_rope, dtype in cases:
        t = prompt + 7  # past the ring more than once
        gen = torch.Generator().manual_seed(window + prompt)
        r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
        # q/k/v and the gate inputs as slices of one product's output (strided), as the decoder gives them
        out = r(b, t, (h + 2 * hk) * d + 2 * hk + h).to(dtype)
        q, k, v = (x.unflatten(-1, (-1, d)).transpose(1, 2) for x in out[..., : (h + 2 * hk) * d].split(
            [h * d, hk * d, hk * d], dim=-1))
        xa, xb, xl = out[..., (h + 2 * hk) * d :].split([hk, hk, h], dim=-1)
        angles = r(b, t, rot // 2) * 3
        cos, sin = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()) if rot else (None, None)
        wq, wk = r(h, d, d) * 0.5, r(hk, d, d) * 0.5
        dt, a_log, mix_bias = r(hk) * 0.1, r(hk) * 0.5, r(h)
        ref = _reference_inputs(q, k, cos, sin, wq, wk, xa, xb, xl, dt, a_log, mix_bias, feature_rope)
        qr, kr, qd, kd = (x.to(dtype) for x in ref[:4])
        mask = torch.ones(b, prompt, dtype=torch.bool)
        mask[1, :pad] = False
        kw = dict(window=window, scale=d ** -0.5, softcap=softcap)
        pre = [qr, kr, qd, kd, v, *ref[4:]]
        _, state = ops.delta_window_chunked(*(x[:, :, :prompt] for x in pre), **kw, key_mask=mask,
                                            output_final_state=True, chunk_size=4)
        twin = ops.RingDeltaState.from_state(state, window)
        ring = ops.FusedRingDeltaState.from_ring(twin.map(torch.clone))
        for i in range(prompt, t):
            sl = slice(i, i + 1)
            want, twin = ops.delta_window_step_ring(*(x[:, :, sl] for x in pre), twin, scale=kw["scale"],
                                                    softcap=softcap)
            pe = (cos[:, sl], sin[:, sl]) if rot else None
            got, ring = delta_step_fused_triton(q[:, :, sl], k[:, :, sl], v[:, :, sl], pe, wq, wk, xa[:, sl], xb[:, sl],
                                                xl[:, sl], dt, a_log, mix_bias, ring, scale=kw["scale"],
                                                softcap=softcap, feature_rope=feature_rope)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            err = (got.float() - want.float()).abs().max().item()
            assert err < tol, (window, prompt, i, err)
            _same_state(ring, twin, 1e-5 if dtype == torch.float32 else 2e-2, (window, prompt, i))


def check_decoder():
    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import tiny_config
    from linearize.fast import FastDecoder
    from linearize.mixers.delta import GatedDeltaAttention
    from linearize.ops.delta import step_triton

    calls, on_cuda = [], GatedDeltaAttention.fused_decoding
    fused_step = step_triton.delta_step_fused_triton
    step_triton.delta_step_fused_triton = lambda *a, **kw: calls.append(1) or fused_step(*a, **kw)
    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding: empty slots in the ring
    for family, feature_rope in (("llama", False), ("gemma2", True)):  # GQA; soft-capping
        torch.manual_seed(0)
        teacher = AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=2)).eval()
        model = linearize.convert(teacher, {"kind": "delta", "window": 4, "feature_rope": feature_rope})
        for m in linearize.mixers(model).values():  # make the memory matter
            m.mix_proj.bias.fill_(0.0)
            m.decay_proj.weight.normal_(0, 0.3)
        model.generation_config.eos_token_id = None
        plain = FastDecoder(model).generate(ids, mask, max_new_tokens=8)
        GatedDeltaAttention.fused_decoding = lambda self: True  # as on CUDA
        fused = FastDecoder(model).generate(ids, mask, max_new_tokens=8)
        GatedDeltaAttention.fused_decoding = on_cuda
        assert calls and torch.equal(fused, plain), family
        calls.clear()


if __name__ == "__main__":
    for name in sys.argv[1:] or ["kernel", "decoder"]:
        globals()[f"check_{name}"]()
    print("ok")
