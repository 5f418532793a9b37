"""Freezing the transferred weights during XATL training: frozen, unfrozen, or LIT.

LIT (XATL's "learning-based incremental thawing", Table 3): the weights copied from the teacher
start frozen while the new ones learn; at every evaluation interval the average validation loss
is compared with the previous interval's, and once its relative improvement has stayed below
``threshold`` (default 1%) for ``patience`` consecutive intervals (default 1), the transferred
weights are unfrozen for the rest of the run.

``LitRule`` is the decision alone (pure, testable on a scripted loss sequence); ``LitCallback`` is
the ``transformers.TrainerCallback`` that applies it inside a Trainer run and logs when it fires: a
warning, a line in the run's ``metrics.jsonl`` (``log_path``) and ``record()`` (the evaluations it
saw, the step it unfroze at and the improvements that triggered it), which the recipes put in
``results.json`` under ``freeze``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..errors import LinearizeError

logger = logging.getLogger(__name__)

FREEZE_MODES = ("frozen", "unfrozen", "lit")


class LitRule:
    """Fires once, at the first interval where the relative improvement of the validation loss,
    ``(previous - current) / |previous|``, has been below ``threshold`` for ``patience`` intervals
    in a row. The first interval has nothing to compare with and never counts. A non-finite loss
    counts as no improvement."""

    def __init__(self, threshold: float = 0.01, patience: int = 1):
        if not isinstance(patience, int) or patience < 1:
            raise LinearizeError(f"LIT patience must be a positive integer, got {patience!r}")
        if not math.isfinite(threshold):
            raise LinearizeError(f"LIT threshold must be a finite number, got {threshold!r}")
        self.threshold, self.patience = float(threshold), patience
        self.history: list[float] = []
        self.strikes = 0
        self.fired_at: int | None = None  # index into history of the interval that fired

    @property
    def fired(self) -> bool:
        return self.fired_at is not None

    def improvement(self, previous: float, current: float) -> float:
        if not (math.isfinite(previous) and math.isfinite(current)) or previous == 0:
            return -math.inf
        return (previous - current) / abs(previous)

    def update(self, loss: float) -> bool:
        """Record one interval's average validation loss; True exactly when this interval fires."""
        loss = float(loss)
        self.history.append(loss)
        if self.fired or len(self.history) < 2:
            return False
        if self.improvement(self.history[-2], loss) < self.threshold:
            self.strikes += 1
        else:
            self.strikes = 0
        if self.strikes >= self.patience:
            self.fired_at = len(self.history) - 1
            return True
        return False


class LitCallback(TrainerCallback, ExportableState):
    """Freeze the transferred weights for a Trainer run: ``mode`` ``frozen`` (the whole run),
    ``unfrozen`` (never: the callback does nothing) or ``lit`` (until ``LitRule`` fires on
    ``metric`` at an evaluation, then unfrozen).

    ``parameters``: names of the parameters to freeze (as in ``model.named_parameters()``), or None
    for those the XATL record says were transferred
    (``linearize.convert.xatl_transfer.transferred_parameters``).
    Freezing sets ``requires_grad=False`` at the start of training, after the Trainer has built
    its optimizer, so the parameters must be trainable (and in the optimizer) when the run starts;
    a frozen parameter gets no gradient, and AdamW then leaves it, its moments and its weight decay
    alone. Evaluations must be enabled (``eval_strategy``) for LIT to ever fire. The state is saved
    with Trainer checkpoints, so a resumed run stays thawed once it has thawed.
    """

    def __init__(self, mode: str = "lit", threshold: float = 0.01, patience: int = 1, metric: str = "eval_loss",
                 parameters: list[str] | None = None, log_path: str | None = None):
        if mode not in FREEZE_MODES:
            raise LinearizeError(f"freeze mode must be one of {', '.join(FREEZE_MODES)}, got {mode!r}")
        self.mode, self.threshold, self.patience, self.metric = mode, threshold, patience, metric
        self.parameters = list(parameters) if parameters is not None else None
        self.log_path = str(log_path) if log_path is not None else None  # metrics.jsonl: a line when LIT fires
        self.rule = LitRule(threshold, patience)
        self.frozen = False
        self.unfrozen_at_step: int | None = None
        self.steps: list[int] = []  # the global step of each evaluation in rule.history
        self._params: dict = {}

    # --- ExportableState: restored attributes are plain values ---
    def state(self) -> dict:
        return {
            "args": {"mode": self.mode, "threshold": self.threshold, "patience": self.patience,
                     "metric": self.metric, "parameters": self.parameters, "log_path": self.log_path},
            "attributes": {"history": list(self.rule.history), "strikes": self.rule.strikes,
                           "fired_at": self.rule.fired_at, "unfrozen_at_step": self.unfrozen_at_step,
                           "steps": list(self.steps)},
        }

    def record(self) -> dict:
        """What the schedule did, for ``results.json``: the mode; under LIT the threshold, patience and
        metric, every evaluation it saw (step, value, relative improvement on the one before) and, once
        it fired, ``unfrozen_at_step`` with the ``trigger``: the last ``patience`` evaluations' steps,
        values and improvements, each below the threshold."""
        out: dict = {"mode": self.mode}
        if self.mode != "lit":
            return out
        h = self.rule.history
        steps = self.steps if len(self.steps) == len(h) else [None] * len(h)  # a state saved before steps were kept
        evaluations = [{"step": s, "value": v,
                        "improvement": None if i == 0 else _finite(self.rule.improvement(h[i - 1], v))}
                       for i, (s, v) in enumerate(zip(steps, h))]
        out.update(threshold=self.threshold, patience=self.patience, metric=self.metric, evaluations=evaluations,
                   unfrozen_at_step=self.unfrozen_at_step, fired=self.rule.fired)
        if self.rule.fired and self.rule.fired_at is not None:
            at = self.rule.fired_at
            out["trigger"] = {"step": evaluations[at]["step"], "value": h[at], "previous": h[at - 1],
                              "improvements": [e["improvement"] for e in evaluations[at - self.patience + 1: at + 1]]}
        return out

    # the rule's progress, as attributes Trainer can set when it restores the callback on resume
    @property
    def history(self) -> list[float]:
        return self.rule.history

    @history.setter
    def history(self, value):
        self.rule.history = [float(x) for x in value]

    @property
    def strikes(self) -> int:
        return self.rule.strikes

    @strikes.setter
    def strikes(self, value):
        self.rule.strikes = int(value)

    @property
    def fired_at(self) -> int | None:
        return self.rule.fired_at

    @fired_at.setter
    def fired_at(self, value):
        self.rule.fired_at = value

    def _resolve(self, model) -> dict:
        if self.parameters is None:
            from ..convert.xatl_transfer import transferred_parameters

            return transferred_parameters(model)
        params = dict(model.named_parameters())
        missing = [n for n in self.parameters if n not in params]
        if missing:
            raise LinearizeError(f"LIT: the model has no parameter(s) {missing[:3]}")
        return {n: params[n] for n in self.parameters}

    def _set(self, trainable: bool) -> None:
        for p in self._params.values():
            p.requires_grad_(trainable)
        self.frozen = not trainable

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.mode == "unfrozen":
            return
        self._params = self._resolve(model)
        if optimizer is not None:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            outside = [n for n, p in self._params.items() if id(p) not in held]
            if outside and self.mode == "lit":
                raise LinearizeError(f"LIT: {len(outside)} transferred parameters (e.g. {outside[0]}) are not in the "
                                     "optimizer; keep them trainable until the run starts, the callback freezes them")
        if self.mode == "lit" and self.rule.fired:
            self._set(True)
            return
        self._set(False)
        n = sum(p.numel() for p in self._params.values())
        logger.info("%s: %d transferred tensors (%s parameters) frozen%s", self.mode, len(self._params), f"{n:,}",
                    f"; thawed when the {self.metric} improvement stays below {self.threshold:.2%} for "
                    f"{self.patience} interval(s)" if self.mode == "lit" else "")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.mode != "lit" or self.rule.fired or not metrics or self.metric not in metrics:
            return
        self.steps.append(state.global_step)
        if self.rule.update(metrics[self.metric]):
            self._set(True)
            self.unfrozen_at_step = state.global_step
            h = self.rule.history
            message = (f"LIT fired at step {state.global_step}: {self.metric} {h[-2]:.4f} -> {h[-1]:.4f} "
                       f"improved less than {self.threshold:.2%} for {self.patience} interval(s); "
                       f"{len(self._params)} transferred tensors unfrozen")
            logger.warning(message)
            state.log_history.append({"lit_unfrozen": 1.0, "step": state.global_step})
            if self.log_path is not None and getattr(state, "is_world_process_zero", True):
                trigger = self.record()["trigger"]
                line = {"stage": "uptrain", "step": state.global_step, "lit_unfrozen": 1.0, "lit_metric": self.metric,
                        "lit_previous": trigger["previous"], "lit_value": trigger["value"],
                        "lit_improvements": trigger["improvements"], "lit_threshold": self.threshold,
                        "lit_patience": self.patience}
                with Path(self.log_path).open("a") as fh:
                    fh.write(json.dumps(line) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        if self.frozen:  # leave the model trainable as it was given
            self._set(True)


def _finite(x: float) -> float | None:
    """JSON has no infinity: a non-finite improvement (a non-finite loss) is None."""
    return x if math.isfinite(x) else None
