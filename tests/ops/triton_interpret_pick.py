"""Run by test_pick_triton.py in a subprocess, on the CPU through Triton's interpreter: a greedy step's bookkeeping
as one launch (``ops/pick_triton.py``) against the PyTorch lines it stands for (``decode.loop.DecodeStep``), and
the fast decoder greedy with and without it.

``pick``: several steps in a row (the buffers it counts in must come back as they were), logits in blocks of 64
(``BLOCK`` patched) so that each sequence's maximum is merged across programs: ties within a block and across
blocks (the first index wins), a NaN (it wins), -0 against +0 (a tie), every logit -inf (index 0), bf16 and fp32
logits, a strided view of the last position; with EOS ids (one, two), sequences already finished (padded, still
finished) and a pad that is itself an EOS. ``decoder``: tiny LoLCATs students (Llama, Gemma 2) decoding greedily
from a left-padded batch through ``FastDecoder``, with and without an EOS, the same tokens as without the kernel."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from helpers import greedy_step_reference  # noqa: E402
from linearize.ops import pick_triton  # noqa: E402
from linearize.ops.pick_triton import PickBuffers, greedy_step_triton  # noqa: E402

torch.set_grad_enabled(False)
pick_triton.BLOCK = 64


def _logits(b, v, gen, dtype, step):
    x = torch.randn(b, 1, v, generator=gen) * 3
    if step % 4 == 1:  # equal maxima: two in one block, one in a later block; the first must win
        x[0, 0, [70, 75, v - 3]] = 50.0
    if step % 4 == 2 and b > 1:  # a NaN beats everything; -0 ties +0 where every other logit is lower
        x[1, 0, v - 100] = float("nan")
        x[0].fill_(-1.0)
        x[0, 0, v - 2], x[0, 0, 20] = 0.0, -0.0
    if step % 4 == 3:
        x[-1].fill_(float("-inf"))
    return x.to(dtype)[:, -1]  # [B, V], a strided view as the decoder gives it


def check_pick():
    gen = torch.Generator().manual_seed(0)
    for b, v, dtype, eos, pad in ((1, 300, torch.float32, None, 0), (3, 257, torch.bfloat16, None, 5),
                                  (3, 300, torch.float32, [7], 7), (4, 130, torch.bfloat16, [3, 9], 0)):
        n = 12
        ids = None if eos is None else torch.tensor(eos)
        state = [torch.randint(0, v, (b, 1)), torch.full((b, n + 1), -1, dtype=torch.long), torch.tensor(0),
                 torch.arange(b)[:, None] + 4, torch.tensor([i % 2 == 1 for i in range(b)])]
        twin = [x.clone() for x in state]
        work = PickBuffers.make(b, "cpu")
        for step in range(n):
            logits = _logits(b, v, gen, dtype, step)
            if eos is not None and step == 5:  # an EOS token as the winner
                logits = logits.clone()
                logits[0, eos[-1]] = 1000.0
            token, seq, position, position_ids, finished = state
            greedy_step_triton(logits, token, seq[:, 1:], position, position_ids, work,
                               finished if ids is not None else None, ids, pad)
            t2, s2, p2, i2, f2 = twin
            greedy_step_reference(logits, t2, s2[:, 1:], p2, i2, f2, ids, pad)
            where = (b, v, str(dtype), eos, step)
            for got, want in zip(state, twin):
                assert torch.equal(got, want), (where, got, want)
            assert (work.best == pick_triton._LOWEST).all() and not work.counts.any(), where
    print("pick", file=sys.stderr)


def check_decoder():
    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import tiny_config
    from linearize.decode import FastDecoder, loop

    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    for family in ("llama", "gemma2"):
        torch.manual_seed(0)
        teacher = AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=2)).eval()
        model = linearize.convert(teacher, {"kind": "lolcats", "window": 4, "feature_dim": 8})
        default = loop.PICK_KERNEL
        for eos in (None, 5):
            model.generation_config.eos_token_id = eos
            loop.PICK_KERNEL = False
            plain = FastDecoder(model).generate(ids, mask, max_new_tokens=12, pad_token_id=0, eos_token_id=eos)
            loop.PICK_KERNEL = True
            calls = []
            pick_triton.greedy_step_triton = lambda *a, **k: calls.append(1) or greedy_step_triton(*a, **k)
            try:
                picked = FastDecoder(model).generate(ids, mask, max_new_tokens=12, pad_token_id=0, eos_token_id=eos)
            finally:
                loop.PICK_KERNEL = default
                pick_triton.greedy_step_triton = greedy_step_triton
            assert torch.equal(picked, plain), (family, eos, picked, plain)
            assert len(calls) == picked.shape[1] - ids.shape[1] - 1 > 0, (family, eos, len(calls))  # every step


if __name__ == "__main__":
    for name in sys.argv[1:] or ["pick", "decoder"]:
        globals()[f"check_{name}"]()
    print("ok")
