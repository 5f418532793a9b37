"""The window softmax as causal flash-attention calls on blocks, merged by their log-sum-exp (no gradient).

A query at position ``p`` attends the keys ``p - W + 1 .. p``. Cut the sequence into blocks of ``C = W - 1``
tokens: query ``j`` of block ``i`` then attends keys ``0 .. j`` of its own block (causal attention on the block)
and keys ``j .. C - 1`` of the block before (``m >= j``: causal attention once both the block's queries and the
previous block's keys are read in reverse). That is ``(j + 1) + (C - j) = W`` keys, each exactly once, and each part
is a mask-free causal call that the fused flash kernels take (the masked band of ``window_softmax_sdpa`` sends
SDPA to slower kernels over twice the keys). The two parts' outputs are merged with their log-sum-exps.

The private ``aten`` flash ops return the log-sum-exp but no gradient through it, so this form serves prefill and
evaluation (``torch.no_grad``); training keeps ``window_softmax_sdpa``. No soft-cap, no padding mask (the
dispatcher in ``ops/window`` keeps those on the other forms).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# The fewest window tokens for which ``window_softmax`` takes this form: shorter windows mean many small blocks.
MIN_WINDOW = 256
# False once the flash kernels have refused an input (``refused``): the process keeps the other forms.
AVAILABLE = True


def refused(err: Exception) -> None:
    """The flash kernels refused (an older GPU, a build without them): say so once, and take the other forms."""
    global AVAILABLE
    AVAILABLE = False
    logger.warning("window-softmax layers prefill through SDPA on masked blocks, not flash blocks: %s",
                   str(err).splitlines()[0] if str(err) else type(err).__name__)


def _causal_with_lse(q, k, v, scale: float):
    """Causal attention (query ``j`` over keys ``0 .. j``) ``[N, H, C, D]`` and its natural log-sum-exp
    ``[N, H, C]`` (fp32, or float64 for float64 inputs): the flash kernel of the inputs' device."""
    if q.device.type == "cuda":
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out[0], out[1]


def supported(q, k, v, window: int, softcap=None, key_mask=None) -> bool:
    """Whether ``window_softmax_flash`` takes these inputs: no gradient wanted, no soft-cap or padding mask, a
    window of at least ``MIN_WINDOW`` shorter than the sequence, half precision on CUDA (the flash kernel's
    dtypes, head dims up to 256) or any floating dtype on the CPU."""
    if not AVAILABLE or (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
        return False
    if softcap is not None or key_mask is not None or window < MIN_WINDOW or q.shape[2] <= window:
        return False
    if q.device.type == "cuda":
        return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and v.shape[-1] == q.shape[-1]
    return q.device.type == "cpu" and q.dtype.is_floating_point


def window_softmax_flash(q, k, v, *, window: int, scale: float):
    """Softmax over each query's last ``window`` keys (itself included), ``q [B, H, T, D]``, ``k``/``v``
    ``[B, Hk, T, D]`` (grouped heads repeated for the kernels), output in ``q``'s dtype. See the module."""
    b, h, t, d = q.shape
    c = window - 1
    n = -(-t // c)
    pad = n * c - t
    grp = h // k.shape[1]
    k, v = (x.to(q.dtype).repeat_interleave(grp, dim=1) if grp > 1 else x.to(q.dtype) for x in (k, v))
    blocks = lambda x: F.pad(x, (0, 0, 0, pad)).unflatten(2, (n, c)).transpose(1, 2).flatten(0, 1)  # noqa: E731
    qb, kb, vb = blocks(q), blocks(k), blocks(v)  # [B N, H, C, D]: padding at the end, seen by no real query
    own, own_lse = _causal_with_lse(qb, kb, vb, scale)
    if n == 1:  # no block before: causal attention on the sequence
        return own.view(b, h, c, -1)[:, :, :t]
    # the previous block's keys, block and keys read backwards: query j over keys j .. C - 1 is causal
    qp = qb.unflatten(0, (b, n))[:, 1:].flatten(0, 1).flip(2)
    kp, vp = (x.unflatten(0, (b, n))[:, :-1].flatten(0, 1).flip(2) for x in (kb, vb))
    prev, prev_lse = _causal_with_lse(qp, kp, vp, scale)
    prev, prev_lse = prev.flip(2), prev_lse.flip(2)
    own, own_lse = own.unflatten(0, (b, n)), own_lse.unflatten(0, (b, n))
    first, rest, rest_lse = own[:, :1], own[:, 1:], own_lse[:, 1:]  # block 0 has no block before it
    prev, prev_lse = prev.unflatten(0, (b, n - 1)), prev_lse.unflatten(0, (b, n - 1))
    top = torch.maximum(rest_lse, prev_lse)
    w_own, w_prev = (rest_lse - top).exp(), (prev_lse - top).exp()
    acc = rest_lse.dtype
    merged = (rest.to(acc) * w_own[..., None] + prev.to(acc) * w_prev[..., None]) / (w_own + w_prev)[..., None]
    out = torch.cat([first, merged.to(q.dtype)], dim=1)  # [B, N, H, C, D]
    return out.transpose(1, 2).flatten(2, 3)[:, :, :t]
