"""Run by test_delta.py in a subprocess, on the CPU through Triton's interpreter: the delta hybrid's fused
ring step (``ops/delta/step_triton.py``).

``kernel``: against the PyTorch ring step (``delta_window_step_ring``), token after token from a prefill's
state: outputs and every buffer of the state (GQA, soft-capping, a window the prompt does not fill, left
padding, fp32 and bf16 buffers).
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
from linearize.ops.delta.step_triton import delta_window_step_ring_triton  # noqa: E402

torch.set_grad_enabled(False)


def _inputs(b, h, hk, t, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(b, h, t, d), r(b, hk, t, d), r(b, hk, t, d)
    qd, kd = F.normalize(r(b, h, t, d), dim=-1), F.normalize(r(b, hk, t, d), dim=-1)
    gate, beta, lam = -F.softplus(r(b, hk, t)), torch.sigmoid(r(b, hk, t)), torch.sigmoid(r(b, h, t))
    return [x.to(dtype) for x in (q, k, qd, kd, v)] + [gate, beta, lam]


def check_kernel():
    b, h, hk, d = 2, 4, 2, 16
    for window, prompt, pad, softcap, dtype in ((4, 7, 3, None, torch.float32), (4, 2, 1, 2.0, torch.float32),
                                                (3, 6, 0, None, torch.bfloat16)):
        n = 7  # past the ring more than once
        xs = _inputs(b, h, hk, prompt + n, d, dtype, seed=window + prompt)
        mask = torch.ones(b, prompt, dtype=torch.bool)
        mask[1, :pad] = False
        kw = dict(window=window, scale=d ** -0.5, softcap=softcap)
        _, state = ops.delta_window_chunked(*(x[:, :, :prompt] for x in xs), **kw, key_mask=mask,
                                            output_final_state=True, chunk_size=4)
        ring = ops.RingDeltaState.from_state(state, window)
        twin = ring.map(torch.clone)
        for i in range(prompt, prompt + n):
            step = [x[:, :, i : i + 1] for x in xs]
            want, twin = ops.delta_window_step_ring(*step, twin, scale=kw["scale"], softcap=softcap)
            got, ring = delta_window_step_ring_triton(*step, ring, scale=kw["scale"], softcap=softcap)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            err = (got.float() - want.float()).abs().max().item()
            assert err < tol, (window, prompt, i, err)
            for a, c in zip(ring.tensors(), twin.tensors()):
                if a.dtype in (torch.bool, torch.long):
                    assert torch.equal(a, c), (window, prompt, i)
                else:
                    assert (a.float() - c.float()).abs().max().item() < 1e-5, (window, prompt, i)


def check_decoder():
    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import tiny_config
    from linearize.fast import FastDecoder
    from linearize.mixers.delta import GatedDeltaAttention
    from linearize.ops.delta import step_triton

    calls, on_cuda = [], GatedDeltaAttention.fused_decoding
    fused_step = step_triton.delta_window_step_ring_triton
    step_triton.delta_window_step_ring_triton = lambda *a, **kw: calls.append(1) or fused_step(*a, **kw)
    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding: empty slots in the ring
    for family in ("llama", "gemma2"):  # GQA; soft-capping
        torch.manual_seed(0)
        teacher = AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=2)).eval()
        model = linearize.convert(teacher, {"kind": "delta", "window": 4})
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
