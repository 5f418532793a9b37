"""Distillation losses: each one small component with one signature, chosen by name in a recipe.

=================  ===============================================================================
``next_token``      the student's own next-token cross-entropy (capturable in a CUDA graph)
``attention_mse``   LoLCATs attention transfer: each layer's output vs the softmax attention it
                    replaced, teacher-forced (+ Hedgehog's attention-weight cross-entropy;
                    captured whole in a CUDA graph: it runs the student's forward itself)
``hidden_mse``      each layer's (or block's) output hidden states vs the teacher's, teacher-forced
``mixer_mse``       each new mixer's output vs the teacher's attention output at its layer,
                    teacher-forced, from a frozen teacher (RADLADS / MOHAWK alignment; SUPRA, XATL)
``kl``              KL(teacher || student) of the next-token distributions (temperature; full or
                    top-k; capturable: the teacher's logits enter the graph as inputs)
=================  ===============================================================================

A recipe names its objective as a string (``"kl+next_token"``, ``"0.5*kl+next_token"``) and gives
per-loss options (``{"kl": {"temperature": 2.0, "top_k": 64}}``): ``build_objective``. The losses
that compare with the teacher read it from a ``SameModelTeacher`` (the student with its mixers
swapped back to softmax) or a ``FrozenTeacher`` (a separate frozen copy): ``teachers.py``.

A new loss is one file in this folder: a ``Loss`` dataclass with a ``name`` (its fields are its
options) registers itself when the package imports its modules, below.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import LOSSES, Loss, Objective, Step, build_objective, check_options, parse_objective
from .probes import AttentionTransferProbe, SoftmaxAttention, softmax_view, swapped, transfer_probes, unwrap
from .teachers import TEACHER_FORMS, FrozenTeacher, SameModelTeacher, TeacherOutputs, make_teacher

_INFRASTRUCTURE = {"base", "probes", "hooks", "teachers"}
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _INFRASTRUCTURE:
        importlib.import_module(f"{__name__}.{_module.name}")

from .attention import AttentionMSE, layer_mse  # noqa: E402
from .next_token import NextToken, next_token_loss  # noqa: E402

__all__ = [
    "LOSSES", "AttentionMSE", "AttentionTransferProbe", "FrozenTeacher", "Loss", "NextToken", "Objective",
    "SameModelTeacher", "SoftmaxAttention", "Step", "TEACHER_FORMS", "TeacherOutputs", "build_objective",
    "check_options", "layer_mse", "make_teacher", "next_token_loss", "parse_objective", "softmax_view", "swapped",
    "transfer_probes", "unwrap",
]
