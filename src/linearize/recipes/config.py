"""One run configuration: the settings every recipe shares, declared once (``RunConfig``), each
with the help text of its command-line flag.

A recipe's config subclasses ``RunConfig`` and declares its own settings the same way
(``setting(default, help)``); it may redeclare a shared setting's default without repeating its
help. ``add_flags`` derives a command's flags from these fields (``--block-len`` from
``block_len``: the type from the annotation, a bool as a switch, choices, help and the value of a
bare flag from the field), so a setting is written once and the CLI, a YAML recipe (``--config``)
and the saved ``run_config.json`` name it the same way. Every flag's default is None: the budget
preset, the file and the config's own default decide what an unset flag means (``linearize.cli``).

Nothing here, nor in the recipes' configs (``recipes.settings``), imports torch: ``linearize <command>
--help`` describes every flag without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field

__all__ = ["MODES", "RunConfig", "add_flags", "flag_help", "graph_mode", "resolve_budget", "setting"]

_NONE = type(None)

MODES = ("auto", "on", "off")  # the cuda_graph setting of the recipes that train with linearize.graphed


def resolve_budget(budget: str | None) -> str:
    """A recipe's token budget: ``budget``, else gpu on CUDA and cpu otherwise (torch imported only then)."""
    if budget:
        return budget
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def graph_mode(value) -> str:
    """``value`` as one of ``MODES``: a YAML recipe's or an earlier run config's true/false is on/off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value in MODES:
        return value
    from ..errors import LinearizeError

    raise LinearizeError(f"cuda_graph must be auto, on or off (or true/false), got {value!r}")


def setting(default=dataclasses.MISSING, help: str | None = None, *, choices=None, metavar: str | None = None,
            const=None, default_factory=dataclasses.MISSING):
    """A config field with what its flag needs: ``help`` (None: no flag of its own), ``choices``, and
    ``const``: the value of the flag given without one (``--cuda-graph`` is ``--cuda-graph on``)."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "metavar": metavar, "const": const}
    return field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass
class RunConfig:
    """What every training recipe takes: the teacher, the data, batches, evaluation, the seed, and the
    loss learnt from the teacher. ``spec``, ``keep_softmax``, ``teacher``, ``out`` and ``dtype`` come
    through flags of their own (the mixer spec's, ``--teacher``, ``--out``, ``--dtype``)."""

    teacher: str | None = None
    out: str = "runs/run"
    spec: dict = field(default_factory=dict)
    keep_softmax: tuple[int, ...] | str = ()
    data: str | None = setting(None, "training text: a .txt/.md/.jsonl file, a folder, hf:NAME, generated:NAME, "
                                     "corpus:NAME, or a mixture A=W,B=W (see 'linearize data --help'; default: "
                                     "Gutenberg)")
    block_len: int = setting(1024, "tokens per training block (packed sequences)")
    train_blocks: int | None = setting(None, "use at most this many training blocks")
    repeats: float = setting(0.0, "share of the training blocks rewritten so that a span of 16-128 of their tokens "
                                  "comes again verbatim at least 128 tokens later: the teacher's copying from far back, "
                                  "for the student to imitate (default 0: the text as it is)")
    eval_blocks: int = setting(16, "validation blocks for early stopping and perplexity")
    batch_size: int = setting(8, "blocks per device per step")
    grad_accum: int = setting(1, "gradient accumulation steps")
    eval_steps: int = setting(100, "evaluate (and checkpoint) every N steps")
    keep_checkpoints: int = setting(2, "resumable checkpoints (weights, optimizer state, data position) kept in "
                                       "OUT, the newest N, one written every --eval-steps and at the end; 0 writes "
                                       "none (OUT/final only: --resume starts over, and early stopping, which "
                                       "returns to the best checkpoint, is off), e.g. where an optimizer's state "
                                       "would not fit the disk", metavar="N")
    profile_steps: int = setting(0, "profile N steps of each training stage after its set-up with torch.profiler: "
                                    "the kernels by time, the GPU's busy share (under FSDP the collectives too), "
                                    "in OUT/<stage>/profile.json and on stdout; those steps run slower and count in "
                                    "the stage's tok/s (default 0: none)", metavar="N")
    gradient_checkpointing: bool = setting(False, "recompute each decoder layer's activations in the backward instead "
                                                  "of keeping them (transformers' gradient checkpointing): a step "
                                                  "keeps each layer's input and one layer's activations at a time, for "
                                                  "about one more forward; the steps then train eagerly, not as CUDA "
                                                  "graphs. For a model whose activations do not fit (a 70B shape under "
                                                  "FSDP); default off")
    patience: int | None = setting(None, "early stopping: evaluations without improvement")
    seed: int = setting(0, "seed for data order and initialisation")
    dtype: str | None = None
    resume: bool = setting(False, "continue from the newest checkpoints in OUT")
    # learning from the teacher (linearize.distill)
    loss: str = setting("lm", "lm (next-token, the paper's; default), kl (KL to the teacher's next-token "
                              "distribution, the teacher running beside the student), kl+lm, or any weighted sum "
                              "of the linearize.distill losses (e.g. 0.5*kl+lm)")
    kl_temperature: float = setting(1.0, "KL: softmax temperature of both models (default 1)")
    kl_top_k: int | None = setting(None, "KL: over the teacher's k most likely tokens only (default: the whole "
                                         "vocabulary)")
    sample_prompt: str = "It is a truth universally acknowledged, that"

    def loss_options(self) -> dict:
        """The options ``build_objective`` takes for ``loss``'s terms from these settings."""
        return {"kl": {"temperature": self.kl_temperature, "top_k": self.kl_top_k}}

    # what the paper used, shown beside a flag's help (setting -> note)
    PAPER: typing.ClassVar[dict] = {}


def _field_metadata(cls, name: str) -> dict:
    """The first declaration of ``name`` along ``cls``'s bases that carries flag metadata."""
    for klass in cls.__mro__:
        f = getattr(klass, "__dataclass_fields__", {}).get(name)
        if f is not None and f.metadata.get("help"):
            return dict(f.metadata)
    raise KeyError(f"{cls.__name__}.{name} has no flag (no help text)")


def flag_help(cls, name: str) -> str:
    """The help text of setting ``name`` of config class ``cls``."""
    return _field_metadata(cls, name)["help"]


def _flag_type(annotation):
    """int / float / str for a field's annotation (``int | None`` -> int; a union with str -> str)."""
    args = [a for a in typing.get_args(annotation) if a is not _NONE] or [annotation]
    if str in args:
        return str
    base = typing.get_origin(args[0]) or args[0]
    return base if base in (int, float, str, bool) else str


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls, names, notes: dict | None = None,
              helps: dict | None = None) -> None:
    """Add ``--<name>`` for each setting in ``names`` of config class ``cls``, derived from its field:
    a bool is a switch, others take a value of the annotated type (optional where the field has a
    ``const``); help from the field (``helps`` replaces it for this command), with a parenthesised
    remark from ``notes`` (default: ``cls.PAPER``, the paper's values)."""
    hints = typing.get_type_hints(cls)
    notes = cls.PAPER if notes is None else notes
    for name in names:
        meta = _field_metadata(cls, name)
        text = (helps or {}).get(name) or meta["help"]
        if notes and name in notes:
            text = f"{text} ({notes[name]})"
        kwargs: dict = {"help": text.replace("%", "%%"), "default": None}
        kind = _flag_type(hints[name])
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = kind
            if meta.get("choices"):
                kwargs["choices"] = list(meta["choices"])
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
            if meta.get("const") is not None:
                kwargs.update(nargs="?", const=meta["const"])
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)
