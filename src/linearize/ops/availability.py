"""Which optional kernel libraries can run here: fla (flash-linear-attention) and Triton.

Asked once per process (cached); kept apart from the kernels themselves so that any op can ask
without importing another op's module.
"""

from __future__ import annotations

import functools


@functools.cache
def fla_available() -> bool:
    """fla importable (its import also initialises Triton): its CUDA kernels can run."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: F401
    except Exception:  # ImportError, or triton failing to initialise
        return False
    return True


@functools.cache
def triton_available() -> bool:
    """Triton importable: our own fused kernels (selective scan, decode steps) can run on CUDA."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
