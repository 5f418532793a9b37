"""Small helpers the hybrid's PyTorch forms share (``naive.py``, ``chunk.py``, ``recurrent.py``,
``state.py``; ``ops/delta/window.py`` borrows ``_scores`` and ``pad_front``): the normaliser and the
apart-normalised mix, the scores (soft-capped), padding keys zeroed, a ring's empty slots."""

from __future__ import annotations

import torch


def _normalise(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den``, 0 where ``den`` is 0 (a padding query: no term, ``num`` is 0 too), with a finite
    gradient there (dividing by a clamped ``den`` sent ``dy / tiny`` back, which overflowed to inf
    and met the masks' zeros as NaN)."""
    return num / torch.where(den > 0, den, torch.ones((), dtype=den.dtype, device=den.device))


def _mixed(window_out: torch.Tensor, linear_out: torch.Tensor, mix: torch.Tensor | None) -> torch.Tensor:
    """The output from the window's and the linear terms' ``[..., D + 1]`` sums (numerators, then the
    denominator): one shared normaliser (``mix`` None, LoLCATs), or each normalised on its own and
    mixed, ``(1 - m) y_window + m y_linear`` with ``m`` broadcast like the sums' leading dims (``m`` is 0
    for a query with no linear term yet)."""
    if mix is None:
        out = window_out + linear_out
        return _normalise(out[..., :-1], out[..., -1:])
    den = linear_out[..., -1:]
    m = mix * (den > 0)
    return (1 - m) * _normalise(window_out[..., :-1], window_out[..., -1:]) + m * _normalise(linear_out[..., :-1], den)


def _mix_shape(mix: torch.Tensor | None, n_kv: int, dims: int, dtype) -> torch.Tensor | None:
    """``mix`` ``[H]`` as ``[Hk, G, 1, ...]`` with ``dims`` trailing ones."""
    return None if mix is None else mix.to(dtype).reshape(n_kv, -1, *([1] * dims))


def _scores(q, k, scale, softcap):
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return s


def _real_keys(key_mask, *tensors):
    """Zero the features and values of padding tokens (``key_mask`` [B, T], True = real)."""
    if key_mask is None:
        return tensors
    keep = key_mask[:, None, :, None]
    return tuple(torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device)) for t in tensors)


def pad_front(x: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    """``x`` with ``pad`` zeros in front along ``dim``: a ring's empty slots before a prefill's window."""
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x.new_zeros(shape), x], dim=dim)
