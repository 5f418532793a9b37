"""Pure tensor functions: every mixer's math in a quadratic reference, a chunked form and a step.

No ``nn.Module`` and no model knowledge here. ``linear_attention`` picks the fla CUDA kernels when
they apply and the PyTorch chunked form otherwise; ``hybrid_attention`` our Triton kernels. The
LoLCATs hybrid and its sparse cache are a package of their own, ``hybrid/``, one file per form.
"""

import torch

from .delta import (
    DeltaWindowState,
    FusedRingDeltaState,
    RingDeltaState,
    delta_window_chunked,
    delta_window_naive,
    delta_window_recurrent,
    delta_window_step,
    delta_window_step_ring,
    empty_delta_window_state,
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_fla,
    gated_delta_rule_naive,
    gated_delta_rule_step,
)
from .fla_backend import fla_available, kernel_inputs, linear_attention_fla, use_fla
from .hybrid import (
    FusedRingState,
    FusedSinkState,
    HybridState,
    RingHybridState,
    RingSparseState,
    SparseHybridState,
    empty_hybrid_state,
    empty_sparse_hybrid_state,
    hybrid_attention,
    hybrid_attention_chunked,
    hybrid_attention_naive,
    hybrid_attention_recurrent,
    hybrid_attention_step,
    hybrid_attention_step_ring,
    hybrid_attention_weights,
    hybrid_final_state,
    sparse_hybrid_attention_chunked,
    sparse_hybrid_attention_naive,
    sparse_hybrid_attention_recurrent,
    sparse_hybrid_attention_step,
    sparse_hybrid_attention_step_ring,
    use_hybrid_kernel,
)
from .hybrid import kernel_dtype as hybrid_attention_kernel_dtype
from .softmax_attention import softmax_attention, softmax_attention_weights
from .linear_attention import (
    accum_dtype,
    empty_state,
    linear_attention_chunked,
    linear_attention_naive,
    linear_attention_recurrent,
    linear_attention_step,
)


def linear_attention(q, k, v, *, log_decay=None, normalize=True, eps=1e-6, initial_state=None,
                     output_final_state=False, chunk_size=64, backend="auto"):
    """Causal (decayed, normalised) linear attention over a sequence; see ``linear_attention.py``."""
    q, k, v = kernel_inputs(q, k, v, backend)
    if use_fla(q, backend):
        return linear_attention_fla(q, k, v, log_decay=log_decay, normalize=normalize, eps=eps,
                                    initial_state=initial_state, output_final_state=output_final_state)
    return linear_attention_chunked(q, k, v, log_decay=log_decay, normalize=normalize, eps=eps,
                                    chunk_size=chunk_size, initial_state=initial_state,
                                    output_final_state=output_final_state)


__all__ = [
    "FusedRingState", "HybridState", "RingHybridState", "accum_dtype", "kernel_inputs", "empty_hybrid_state", "empty_state", "fla_available",
    "hybrid_attention", "hybrid_attention_chunked", "hybrid_attention_naive", "hybrid_attention_recurrent",
    "hybrid_attention_step", "hybrid_attention_step_ring", "hybrid_final_state", "linear_attention", "linear_attention_chunked",
    "linear_attention_fla", "linear_attention_naive", "linear_attention_recurrent",
    "linear_attention_step", "softmax_attention", "softmax_attention_weights", "hybrid_attention_weights",
    "use_fla", "use_hybrid_kernel", "SparseHybridState", "empty_sparse_hybrid_state", "sparse_hybrid_attention_chunked",
    "sparse_hybrid_attention_naive", "sparse_hybrid_attention_recurrent", "sparse_hybrid_attention_step",
    "sparse_hybrid_attention_step_ring", "RingSparseState", "FusedSinkState",
    "DeltaWindowState", "FusedRingDeltaState", "RingDeltaState", "delta_window_chunked", "delta_window_naive",
    "delta_window_recurrent",
    "delta_window_step", "delta_window_step_ring",
    "empty_delta_window_state", "gated_delta_rule", "gated_delta_rule_chunked", "gated_delta_rule_fla",
    "gated_delta_rule_naive", "gated_delta_rule_step",
]
