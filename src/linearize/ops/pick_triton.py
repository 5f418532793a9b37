"""A greedy decode step's bookkeeping as one Triton launch (CUDA): the argmax of each sequence's logits, the EOS
rule, writing the token and advancing the positions, which ``decode.loop.DecodeStep`` otherwise runs as four to
seven PyTorch launches (at batch 1 the argmax alone, one block reducing 49k logits, took 13.5 µs of a 1.02 ms step
on an H200; each other launch 1-2 µs).

``greedy_step_triton`` does, in place, what these PyTorch lines do (``token`` ``[B, 1]``)::

    torch.argmax(logits, dim=-1, keepdim=True, out=token)         # the first of equal maxima; NaN beats all
    if eos:                                                       # sequences past an EOS continue as padding
        token.masked_fill_(finished[:, None], pad)
        finished |= isin(token[:, 0], eos)
    following.index_copy_(1, position.view(1), token)             # the token's column of the whole sequence
    position_ids.add_(1); position.add_(1)

Programs: one per (sequence, block of ``BLOCK`` logits). Each finds its block's largest logit and first index
and folds them into the sequence's best as one 64-bit atomic max (the logit's order-keeping bits above, the
complement of its index below: among equal logits the first index wins); it then counts itself in (an atomic add),
and the last of the sequence's programs to arrive takes the best (resetting it), applies the EOS rule and writes
the token; the last sequence to finish advances ``position``, which every sequence read before it counted in.
The buffers it counts in (``PickBuffers``, made once a decode) are left as they started, so a CUDA graph replays
the launch as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits a program reads
_LOWEST = -(2**63)  # the best's start: below every packed (key, index)


@dataclass
class PickBuffers:
    """What ``greedy_step_triton`` counts in, made once for ``batch`` sequences: each sequence's best so far
    (int64, ``_LOWEST`` between steps) and the arrival counts (int32 zeros between steps: one per sequence, one
    for the sequences)."""

    best: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def make(cls, batch: int, device) -> "PickBuffers":
        return cls(torch.full((batch,), _LOWEST, dtype=torch.int64, device=device),
                   torch.zeros(batch + 1, dtype=torch.int32, device=device))


@triton.jit
def _order_key(x):
    """fp32 ``x`` as int32 keys in the same order (NaN above everything, -0 as +0)."""
    x = x + 0.0  # -0.0 + 0.0 is +0.0: the two zeros tie, as they compare equal
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives: the magnitude's bits flipped, so larger is lower
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _greedy_step(logits_ptr, s_lb, V, token_ptr, s_tb, follow_ptr, s_fb, pos_ptr, pid_ptr, s_pb, fin_ptr, eos_ptr,
                 n_eos, pad, best_ptr, cnt_ptr, HAS_EOS: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    cols = j * BV + tl.arange(0, BV)
    real = cols < V
    x = tl.load(logits_ptr + b.to(tl.int64) * s_lb + cols, mask=real, other=float("-inf")).to(tl.float32)
    key = tl.where(real, _order_key(x), -2147483648)  # past the end: below every logit, -inf included
    top = tl.max(key, axis=0)
    first = tl.min(tl.where(key == top, cols, V), axis=0)
    packed = (top.to(tl.int64) << 32) | (4294967295 - first.to(tl.int64))
    tl.atomic_max(best_ptr + b, packed, sem="relaxed")  # ordered before the count below, which releases it
    if tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel") == tl.num_programs(1) - 1:  # the sequence's last block
        tl.store(cnt_ptr + b, 0)
        won = tl.atomic_xchg(best_ptr + b, -9223372036854775808, sem="acq_rel")  # the best, reset to _LOWEST
        token = 4294967295 - (won & 4294967295)
        if HAS_EOS:
            done = tl.load(fin_ptr + b).to(tl.int1)
            token = tl.where(done, pad, token)
            for e in range(n_eos):
                done = done | (token == tl.load(eos_ptr + e))
            tl.store(fin_ptr + b, done.to(tl.int8).to(fin_ptr.dtype.element_ty))
        position = tl.load(pos_ptr)
        tl.store(token_ptr + b * s_tb, token)
        tl.store(follow_ptr + b * s_fb + position, token)
        tl.store(pid_ptr + b * s_pb, tl.load(pid_ptr + b * s_pb) + 1)
        sequences = tl.num_programs(0)
        if tl.atomic_add(cnt_ptr + sequences, 1, sem="acq_rel") == sequences - 1:  # every sequence has read it
            tl.store(cnt_ptr + sequences, 0)
            tl.store(pos_ptr, position + 1)


def greedy_step_triton(logits: torch.Tensor, token: torch.Tensor, following: torch.Tensor, position: torch.Tensor,
                       position_ids: torch.Tensor, work: PickBuffers, finished: torch.Tensor | None = None,
                       eos: torch.Tensor | None = None, pad: int = 0) -> None:
    """The greedy pick and the step's bookkeeping in one launch, in place (the module's docstring).

    ``logits`` ``[B, V]`` (any dtype, last dimension contiguous); ``token`` ``[B, 1]`` and ``following`` ``[B, N]``
    long (``following[:, position]`` takes the token: the whole sequence shifted by one); ``position`` a 0-d long
    tensor; ``position_ids`` ``[B, 1]`` long; ``work`` made for at least B sequences; with ``eos`` (a 1-d long tensor
    of ids) ``finished`` ``[B]`` bool."""
    b, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("the logits' last dimension must be contiguous")
    has_eos = eos is not None and eos.numel() > 0
    fin = finished.view(torch.int8) if has_eos else token  # never read without an EOS
    ids = eos if has_eos else token
    _greedy_step[(b, triton.cdiv(v, BLOCK))](
        logits, logits.stride(0), v, token, token.stride(0), following, following.stride(0), position, position_ids,
        position_ids.stride(0), fin, ids, ids.numel() if has_eos else 0, int(pad), work.best, work.counts,
        HAS_EOS=has_eos, BV=BLOCK)
