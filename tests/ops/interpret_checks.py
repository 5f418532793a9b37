"""Checks shared by the Triton-interpreter scripts (``triton_interpret_*.py``): the relative error bound
and the left-padding mask their cases use."""

import torch

TOL = 2e-5


def _close(got, want, what, floor=1e-6, tol=TOL):
    """Largest error relative to the largest reference entry (at least ``floor``)."""
    err = ((got.double() - want).abs().max() / want.abs().max().clamp_min(floor)).item()
    assert err < tol, (what, err)


def _masks(b, t, pad):
    """``[B, T]`` key mask with the last sequence left-padded by ``pad`` tokens (None for no padding)."""
    if not pad:
        return None
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[-1, :pad] = False  # the last sequence left-padded
    return key_mask
