"""What every loss shares: one signature, a registry by name, weighted sums of losses.

A loss is a small dataclass whose fields are its options; called on a ``Step`` (one training batch
and the forwards run on it so far) it returns a scalar. ``Step`` runs each forward at most once,
on demand, so losses that read the same forward share it (``kl + next_token``: one student
forward, one teacher forward). A subclass with a ``name`` registers itself in ``LOSSES``.

``Objective`` is what a recipe trains: ``objective(model, batch) -> loss`` (the engine's loss
signature), a weighted sum of losses, built by ``build_objective("kl+next_token", ...)``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import LinearizeError
from .probes import unwrap

LOSSES: dict[str, type["Loss"]] = {}
ALIASES = {"lm": "next_token"}  # other names a loss answers to in an objective (--loss lm | kl | kl+lm)


@dataclasses.dataclass
class Loss:
    """One term of a training objective; ``__call__(step) -> scalar tensor``.

    ``capturable``: computed by ``from_outputs`` from the student's own forward plus the tensors
    ``teacher_tensors`` takes from the teacher's forward (eagerly, before a replay; the teacher's
    logits, say), so a CUDA graph can replay it (``linearize.graphed``): those tensors enter the
    graph as inputs. ``captured_whole``: the call itself runs the forward of the student it reads
    (``step.model`` on ``step.batch``, needing no tensor from outside the batch) and nothing in it
    waits on the device, so a CUDA graph can capture the whole call: ``attention_mse``, whose teacher
    is the student's own softmax view. ``needs_teacher``: reads ``step.teacher_outputs()``.
    """

    name: ClassVar[str] = ""
    capturable: ClassVar[bool] = False
    captured_whole: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            LOSSES[cls.name] = cls

    def __call__(self, step: "Step") -> torch.Tensor:
        raise NotImplementedError

    @property
    def n_teacher_tensors(self) -> int:
        """How many tensors ``teacher_tensors`` returns (fixed by the options)."""
        return 0

    def teacher_tensors(self, step: Step) -> tuple[torch.Tensor, ...]:
        """What ``from_outputs`` reads from the teacher, computed from ``step`` without gradients."""
        return ()

    def from_outputs(self, outputs, batch: dict, teacher: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """The loss from the student's forward outputs and ``teacher_tensors`` (capturable losses only)."""
        raise NotImplementedError

    def teacher_capture(self, model: nn.Module) -> tuple[set[int], set[int]]:
        """Decoder layers whose (inputs, outputs) this loss reads from the teacher's forward."""
        return set(), set()

    def teacher_attention(self, model: nn.Module) -> set[int]:
        """Decoder layers whose attention output (before the residual) this loss reads from the teacher."""
        return set()

    @classmethod
    def options(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


class Step:
    """One batch and the forwards run on it. ``model`` is what the Trainer passes (possibly a DDP
    or PEFT wrapper: call it for the forward); ``student`` is the model inside."""

    def __init__(self, model: nn.Module, batch: dict, teacher=None, capture=(set(), set(), set())):
        self.model, self.batch, self.teacher = model, batch, teacher
        self.capture = capture
        self._memo: dict[str, Any] = {}

    @property
    def student(self) -> nn.Module:
        return unwrap(self.model)

    def memo(self, key: str, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def outputs(self):
        """The student's ordinary forward on the batch (with labels: ``.loss`` is next-token)."""
        return self.memo("student", lambda: self.model(input_ids=self.batch["input_ids"], labels=self.batch.get("labels"),
                                                      use_cache=False))

    def teacher_outputs(self):
        """The teacher's forward on the batch (``TeacherOutputs``: logits, recorded layer inputs and
        outputs, attention outputs), without gradients."""
        if self.teacher is None:
            raise LinearizeError("this loss needs the teacher's outputs, but the objective has no teacher")
        return self.memo("teacher", lambda: self.teacher(self.model, self.batch["input_ids"], *self.capture))


def parse_objective(spec) -> list[tuple[float, str]]:
    """``"attention_mse"``, ``"kl+next_token"``, ``"0.5*kl + next_token"`` or ``{"kl": 0.5, "next_token": 1}``
    -> ``[(weight, name), ...]``, names checked against ``LOSSES`` (``ALIASES`` read as their loss:
    ``"kl+lm"`` is ``"kl+next_token"``)."""
    if isinstance(spec, dict):
        terms = [(float(w), str(n)) for n, w in spec.items()]
    elif isinstance(spec, str):
        terms = []
        for part in spec.replace(" ", "").split("+"):
            m = re.fullmatch(r"(?:([0-9.eE+-]+)\*)?([A-Za-z_][A-Za-z0-9_]*)", part)
            if not m:
                raise LinearizeError(f"cannot read the loss {spec!r}: write names joined by +, each optionally "
                                     "weighted as 0.5*name (e.g. kl+next_token)")
            try:
                terms.append((float(m.group(1)) if m.group(1) else 1.0, m.group(2)))
            except ValueError:
                raise LinearizeError(f"cannot read the weight {m.group(1)!r} in the loss {spec!r}") from None
    else:
        raise LinearizeError(f"a loss is a name like kl+next_token or a mapping name -> weight, got {spec!r}")
    if not terms:
        raise LinearizeError("the loss names no term")
    terms = [(w, ALIASES.get(n, n)) for w, n in terms]
    unknown = [n for _, n in terms if n not in LOSSES]
    if unknown:
        raise LinearizeError(f"unknown loss {', '.join(unknown)}; accepted: {', '.join(sorted(LOSSES))} "
                             f"({', '.join(f'{a} = {n}' for a, n in ALIASES.items())})")
    if len({n for _, n in terms}) != len(terms):
        raise LinearizeError(f"the loss {spec!r} names a term twice")
    return terms


def check_options(spec, options: dict | None) -> None:
    """``spec`` reads, and every entry of ``options`` (``{loss name: {option: value}}``) names a
    registered loss and options it has (options of losses ``spec`` does not use are allowed: one
    mapping serves every stage of a recipe)."""
    parse_objective(spec)
    for name, opts in (options or {}).items():
        if name not in LOSSES:
            raise LinearizeError(f"loss_options names an unknown loss {name!r}; accepted: {', '.join(sorted(LOSSES))}")
        if not isinstance(opts, dict):
            raise LinearizeError(f"loss_options.{name} must be a mapping of options, got {opts!r}")
        bad = sorted(set(opts) - set(LOSSES[name].options()))
        if bad:
            raise LinearizeError(f"the {name} loss has no option {', '.join(bad)}; its options: "
                                 f"{', '.join(LOSSES[name].options()) or 'none'}")


class Objective:
    """A weighted sum of losses, called as ``objective(model, batch)``; ``teacher`` supplies the
    teacher's outputs to the losses that need them."""

    def __init__(self, terms: list[tuple[float, Loss]], teacher=None):
        self.terms, self.teacher = terms, teacher

    @property
    def names(self) -> list[str]:
        return [t.name for _, t in self.terms]

    @property
    def capturable(self) -> bool:
        return all(t.capturable for _, t in self.terms)

    @property
    def captured_whole(self) -> bool:
        """Every term runs its own forward and a CUDA graph can capture the call whole (``Loss.captured_whole``)."""
        return all(t.captured_whole for _, t in self.terms)

    @property
    def uncapturable(self) -> list[str]:
        """The terms that keep a CUDA graph from replaying this objective: none where it is captured
        whole, else those not ``capturable``."""
        return [] if self.captured_whole else [t.name for _, t in self.terms if not t.capturable]

    @property
    def needs_teacher(self) -> bool:
        return any(t.needs_teacher for _, t in self.terms)

    def __repr__(self) -> str:
        return " + ".join(t.name if w == 1 else f"{w:g}*{t.name}" for w, t in self.terms)

    def _capture(self, model) -> tuple[set[int], set[int], set[int]]:
        ins, outs, attention = set(), set(), set()
        for _, t in self.terms:
            i, o = t.teacher_capture(unwrap(model))
            ins |= i
            outs |= o
            attention |= t.teacher_attention(unwrap(model))
        return ins, outs, attention

    @staticmethod
    def _sum(values: list[tuple[float, torch.Tensor]]) -> torch.Tensor:
        total = None
        for w, v in values:
            v = v if w == 1 else w * v
            total = v if total is None else total + v
        return total

    def _step(self, model, batch) -> Step:
        if self.needs_teacher and self.teacher is None:
            raise LinearizeError(f"the loss {self!r} needs a teacher; give the objective one")
        return Step(model, batch, self.teacher, self._capture(model) if self.needs_teacher else (set(), set(), set()))

    def __call__(self, model, batch) -> torch.Tensor:
        step = self._step(model, batch)
        return self._sum([(w, t(step)) for w, t in self.terms])

    @torch.no_grad()
    def teacher_tensors(self, model, batch) -> tuple[torch.Tensor, ...]:
        """Every term's ``teacher_tensors`` for ``batch``, one flat tuple in the terms' order (empty
        when no term reads the teacher): what a CUDA-graph replay of ``from_outputs`` takes as inputs."""
        step, flat = self._step(model, batch), []
        for _, t in self.terms:
            got = tuple(t.teacher_tensors(step))
            if len(got) != t.n_teacher_tensors:
                raise LinearizeError(f"the {t.name} loss gave {len(got)} teacher tensors, not its {t.n_teacher_tensors}")
            flat += got
        return tuple(flat)

    def from_outputs(self, outputs, batch, teacher: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """The objective from the student's forward outputs and ``teacher`` (``teacher_tensors``'s
        flat tuple, split back per term by each one's ``n_teacher_tensors``), when ``capturable``."""
        need = sum(t.n_teacher_tensors for _, t in self.terms)
        if len(teacher) != need:
            raise LinearizeError(f"the loss {self!r} reads {need} teacher tensors, got {len(teacher)}")
        values, at = [], 0
        for w, t in self.terms:
            values.append((w, t.from_outputs(outputs, batch, tuple(teacher[at:at + t.n_teacher_tensors]))))
            at += t.n_teacher_tensors
        return self._sum(values)


def build_objective(spec, options: dict | None = None, context: dict | None = None, teacher=None) -> Objective:
    """An ``Objective`` from a loss spec (see ``parse_objective``). ``options``: per-loss options
    (``{"kl": {"temperature": 2.0}}``); ``context``: what the recipe knows at this point (the
    layers being trained, ...), given to each loss that has an option of that name; ``options`` win."""
    check_options(spec, options)
    terms = []
    for weight, name in parse_objective(spec):
        cls = LOSSES[name]
        known = set(cls.options())
        kwargs = {k: v for k, v in (context or {}).items() if k in known}
        kwargs.update((options or {}).get(name, {}))
        try:
            terms.append((weight, cls(**kwargs)))
        except TypeError as exc:
            raise LinearizeError(f"the {name} loss: {exc}") from None
    return Objective(terms, teacher)
