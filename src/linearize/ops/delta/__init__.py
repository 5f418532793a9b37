"""The gated delta rule and the sliding-window hybrid built on it (``kind: delta``).

Files, one form each (the forms equal in float64, tests):

* ``rule.py``: the gated delta rule itself, token by token (``gated_delta_rule_naive``, ``_step``), in
  chunks (``gated_delta_rule_chunked``), through fla on CUDA (``gated_delta_rule_fla``), and the
  dispatcher between them (``gated_delta_rule``);
* ``window.py``: the hybrid (window softmax + the memory of older tokens): the reference
  (``delta_window_naive``), the sequence form (``delta_window_chunked``; the window's softmax is
  ``ops.window``'s), one token (``delta_window_step``), a ring window in place (``delta_window_step_ring``,
  the fast decoder's) and token by token (``delta_window_recurrent``);
* ``state.py``: the hybrid's decoding states (``DeltaWindowState``, its ring ``RingDeltaState``, the fused
  step's ``FusedRingDeltaState``);
* ``step_triton.py``: the fast decoder's step from RoPE to the output as one Triton launch (CUDA; imported
  on first use).
"""

from .rule import (
    empty_delta_state,
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_fla,
    gated_delta_rule_naive,
    gated_delta_rule_step,
)
from .state import DeltaWindowState, FusedRingDeltaState, RingDeltaState, empty_delta_window_state
from .window import (
    delta_window_chunked,
    delta_window_naive,
    delta_window_recurrent,
    delta_window_step,
    delta_window_step_ring,
)

__all__ = [
    "DeltaWindowState", "FusedRingDeltaState", "RingDeltaState", "delta_window_chunked", "delta_window_naive", "delta_window_recurrent",
    "delta_window_step", "delta_window_step_ring", "empty_delta_state", "empty_delta_window_state",
    "gated_delta_rule", "gated_delta_rule_chunked", "gated_delta_rule_fla", "gated_delta_rule_naive",
    "gated_delta_rule_step",
]
