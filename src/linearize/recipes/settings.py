"""Each recipe's settings: ``LolcatsConfig``, ``UptrainConfig`` and its recipes ``SupraConfig`` and
``XatlConfig``, every field a setting of the recipe (``recipes.config``: its flag, YAML key and
``run_config.json`` entry).

They import neither torch nor the recipes' training code, so that ``linearize <command> --help``
describes every flag at once; what a setting does at run time lives in the recipe (``recipes.lolcats``,
``recipes.uptrain``), and a config's methods import what they build from when called. The recipe
modules export their config too (``from linearize.recipes.lolcats import LolcatsConfig``).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from ..errors import LinearizeError
from .config import MODES, RunConfig, graph_mode, setting
from .launch import world_size

__all__ = ["AUTO_SCORES", "DEFAULT_CONFIG", "DEFAULT_DATA", "DEFAULT_SPEC", "LolcatsConfig", "SupraConfig",
           "UptrainConfig", "XatlConfig"]

AUTO_SCORES = ("mse", "recall")  # how keep_softmax auto:K scores the layers (``lolcats.auto_softmax_choice``)
# What ``linearize lolcats`` trains with no flag and no --config on the gpu budget: the packaged recipe file
# ``lolcats_tiers`` (DEFAULT_SPEC's hybrid, 8,192-token blocks of DEFAULT_DATA, and the 14 of SmolLM2's 30 layers
# whose softmax most helps copying kept as the teacher's attention over their last 1,280 tokens, four of them over
# 4,288, with 4 attention sinks and float8 keys and values; the best measured across books, speeches, code and
# technical text, docs/RESULTS.md "Across domains"). Before 2026-11-30's second change it was ``lolcats_wide`` (the
# same without the far tier, the sinks and float8, on 4,096-token blocks), before that ``lolcats_mix``; both stay
# named; the paper's student: ``lolcats_plain``.
DEFAULT_CONFIG = "lolcats_tiers"
# The hybrid of every converted layer (``linearize convert``'s untrained student with no --config; on the cpu budget
# the whole student): LoLCATs' Hedgehog features over a 64-token window, the features read from the q/k before RoPE,
# a data-dependent gate on the linear state, the teacher's own sliding-window layers kept (issue #46's length options).
DEFAULT_SPEC = {"kind": "lolcats", "feature_map": "hedgehog", "feature_dim": 64, "window": 64, "feature_rope": False,
                "decay": "gated", "keep_sliding": True}
# The default training text on the gpu budget: books, Python source and WordNet, never an epoch repeated at its 10M
# tokens per stage (the cpu budget trains on the books alone: no corpus to fetch for a smoke run)
DEFAULT_DATA = "gutenberg,corpus:code,corpus:wordnet"


@dataclass
class LolcatsConfig(RunConfig):
    """The LoLCATs recipe's settings: ``RunConfig``'s shared ones (``loss``: stage 2's; the teacher is
    the student's own projections with softmax attention and LoRA off, no second model) and its stages'."""

    out: str = "runs/lolcats"
    spec: dict = field(default_factory=lambda: dict(DEFAULT_SPEC))
    keep_softmax: tuple[int, ...] | str = ()  # layer indices, or "auto:K" / "auto:F": K layers (a share F of the
    # converted ones) chosen after stage 1
    eval_steps: int = 50
    patience: int | None = 3
    stages: tuple[str, ...] = ("stage1", "stage2")
    # stage 1
    stage1_lr: float = setting(1e-2, "stage 1 learning rate")
    stage1_epochs: float = setting(2.0, "stage 1 epochs")
    stage1_steps: int = setting(-1, "stage 1 optimizer steps (overrides epochs)")
    mse_factor: float = setting(1000.0, "stage 1 loss scale")
    xent_factor: float = setting(0.0, "stage 1: add Hedgehog's cross-entropy on attention weights with this weight "
                                      "(quadratic memory in the block length)")
    layers_per_block: int | None = setting(None, "stage 1 in blocks of k layers (1: layer by layer; default: all "
                                                 "layers jointly); bounds memory by k layers")
    block_inputs: str = setting("cache", "block-wise stage 1: train each block on the teacher's hidden states "
                                         "entering it, computed once and kept in CPU memory (cache, the default, as "
                                         "LoLCATs), or run the earlier layers at every step (recompute: no host memory)",
                                choices=("cache", "recompute"))
    # keep_softmax auto:K: how the K layers are chosen after stage 1
    auto_softmax_score: str = setting("mse", "keep_softmax auto:K keeps softmax the K layers with the largest score: "
                                             "mse (attention-output MSE after stage 1; default) or recall (how much "
                                             "the layer's softmax attention lowers the loss of copying a random "
                                             "span from beyond the window; one layer at a time, each beside those "
                                             "already chosen)",
                                      choices=AUTO_SCORES)
    auto_softmax_distance: int | None = setting(None, "auto_softmax_score recall: tokens from a span's first "
                                                      "occurrence to its copy (default: 4 x the window)",
                                                metavar="N")
    auto_softmax_long: str | None = setting(None, "keep_softmax auto:K with --softmax-window W: N@W2 gives N of "
                                                  "the K layers (or a share 0 < N < 1 of them) a window of W2 tokens "
                                                  "instead of W: those whose softmax most lowers the loss of copying "
                                                  "a span W2 - 64 tokens back, greedily (e.g. 4@4160)", metavar="N@W2")
    # stage 2
    stage2_lr: float = setting(1e-4, "stage 2 (LoRA) learning rate")
    stage2_epochs: float = setting(2.0, "stage 2 epochs")
    stage2_steps: int = setting(-1, "stage 2 optimizer steps (overrides epochs)")
    lora_r: int = setting(8, "LoRA rank")
    lora_alpha: int = setting(16, "LoRA alpha")
    lora_targets: tuple[str, ...] | None = None  # None: the family's q/k/v/o projections
    merge: bool = True
    cuda_graph: str = setting("auto", "auto (default): replay each stage's training steps (forward and backward) as "
                                      "CUDA graphs where the run allows it (CUDA, one GPU or data-parallel under "
                                      "torchrun; not FSDP, a sparse cache, block-wise stage 1 from cached inputs "
                                      "(--layers-per-block with --block-inputs cache) or a stage-2 loss term such as "
                                      "hidden_mse), else train that stage eagerly and say why in one line; on (the "
                                      "flag alone): refuse a run that cannot; off: eagerly. Graphed, the host stops "
                                      "issuing the kernels one by one (thousands per eager step); the first step of "
                                      "each stage (and of each block) captures, a new batch shape captures again; "
                                      "stage 1's attention transfer is captured whole, and with --loss kl the "
                                      "teacher's logits (the student's own softmax view) are computed eagerly before "
                                      "each replay and enter the graphs",
                              choices=MODES, const="on")

    PAPER: typing.ClassVar[dict] = {"stage1_lr": "paper: 1e-2", "stage1_epochs": "paper: 2", "mse_factor": "LoLCATs: 1000",
                                    "xent_factor": "LoLCATs: 0", "stage2_lr": "paper: 1e-4", "stage2_epochs": "paper: 2",
                                    "lora_r": "paper: 8", "lora_alpha": "paper: 16"}

    def __post_init__(self):
        self.cuda_graph = graph_mode(self.cuda_graph)  # a YAML recipe's or an earlier run config's true/false

    def convert_teacher(self, teacher, inplace: bool = True):
        """The student stage 1 trains: ``teacher`` converted as ``spec`` says, but the ``keep_softmax``
        layers (every layer with ``auto:K``, whose K layers are chosen after stage 1)."""
        from ..convert import convert

        keep = None if isinstance(self.keep_softmax, str) else list(self.keep_softmax) or None
        return convert(teacher, self.spec, keep_softmax=keep, inplace=inplace)


@dataclass
class UptrainConfig(RunConfig):
    """What SUPRA and XATL share: ``RunConfig``'s settings, the schedule and the alignment stage. Each
    recipe subclasses it (``SupraConfig``, ``XatlConfig`` below) with its own settings and ``build``: how
    the student is made from the teacher; ``recipes.uptrain.run`` trains any of them."""

    method: str = "uptrain"
    out: str = "runs/uptrain"
    keep_softmax: tuple[int, ...] = ()
    steps: int = setting(1000, "optimizer steps")
    lr: float = setting(3e-4, "peak learning rate")
    min_lr: float = setting(1e-5, "cosine floor")
    warmup_steps: int = setting(100, "linear warmup steps")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    compile: bool = setting(False, "train the model through torch.compile (on CUDA: the mixers' many small "
                                   "elementwise kernels fused; the first steps pay the compilation; `python -m "
                                   "linearize.bench.train --compile` measures the gain)")
    cuda_graph: str = setting("auto", "auto (default): replay each training step's forward and backward as CUDA graphs "
                                      "where the run allows it (CUDA, one GPU or data-parallel under torchrun; not FSDP, "
                                      "--compile or a loss term such as hidden_mse), else train eagerly and say why in "
                                      "one line; on (the flag alone): refuse a run that cannot; off: eagerly. Graphed, "
                                      "the host stops issuing the kernels one by one, which bounds the linear students' "
                                      "eager steps (docs/RESULTS.md); the first step captures, a new batch shape captures "
                                      "again; with --loss kl or kl+lm the teacher's forward runs eagerly before each "
                                      "replay and its logits enter the graphs; the alignment stage trains eagerly",
                              choices=MODES, const="on")
    # learning from the teacher: an alignment stage first
    align_steps: int = setting(0, "an alignment stage first: this many steps fitting each new mixer's output to the "
                                  "teacher's attention output at its layer (teacher-forced, only the mixers train; "
                                  "RADLADS / MOHAWK). Default 0: none")
    align_lr: float | None = setting(None, "learning rate of the alignment stage (default: --lr)")

    # what a recipe defines
    converts_in_place: typing.ClassVar[bool] = False  # the student is the teacher converted: distil from a copy

    def __post_init__(self):
        self.cuda_graph = graph_mode(self.cuda_graph)  # a YAML recipe's or an earlier run config's true/false

    def check(self) -> None:
        """The recipe's own settings, checked before the teacher loads (``check_distillation`` calls it)."""
        if isinstance(self.keep_softmax, str):
            raise LinearizeError(f"keep_softmax {self.keep_softmax} is chosen by LoLCATs' attention transfer "
                                 "(linearize lolcats); here give layer indices (e.g. 2,15)")

    def build(self, teacher):
        """``(student, new_parameters, transfer_report or None)`` from the loaded teacher."""
        raise LinearizeError(f"{type(self).__name__} is no recipe; use linearize.recipes.supra or .xatl")

    def callbacks(self) -> list:
        """Trainer callbacks of the training stage (XATL: LIT)."""
        return []

    def graphs_blocked(self) -> str | None:
        """Why the recipe's own settings keep its training steps from replaying as CUDA graphs (None:
        nothing; ``cuda_graphs`` checks what every recipe shares)."""
        return None

    def stage_before(self) -> int:
        """Steps that train only the new parameters before the training stage (SUPRA's 2-step variant)."""
        return 0


@dataclass
class SupraConfig(UptrainConfig):
    """SUPRA (``recipes.supra``): the teacher converted in place to SUPRA attention, all weights trained."""

    method: str = "supra"
    out: str = "runs/supra"
    spec: dict = field(default_factory=lambda: {"kind": "supra"})
    new_weights_first: int = setting(0, "SUPRA's 2-step variant: train only the new weights (kernel, GroupNorm) "
                                        "for this many steps first")

    converts_in_place: typing.ClassVar[bool] = True
    PAPER: typing.ClassVar[dict] = {"lr": "SUPRA: 3e-4 for ~1B models", "min_lr": "SUPRA: 1e-5", "warmup_steps": "SUPRA: 1000"}

    def build(self, teacher):
        from ..convert import convert

        before = {id(p) for p in teacher.parameters()}
        student = convert(teacher, self.spec, keep_softmax=list(self.keep_softmax) or None, inplace=True)
        return student, [p for p in student.parameters() if id(p) not in before], None

    def stage_before(self) -> int:
        return self.new_weights_first


@dataclass
class XatlConfig(UptrainConfig):
    """XATL (``recipes.xatl``): a RetNet or Mamba student built from the teacher's shared weights."""

    method: str = "xatl"
    out: str = "runs/xatl"
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    arch: str = setting("retnet", "the new token mixer (default: retnet)", choices=("retnet", "striped_mamba"))
    transfer: tuple[str, ...] | str | None = setting(
        None, "comma-separated: embeddings, ffn, wo, attention (the kept softmax layers), qkv (RetNet: the "
              "retention's q/k/v from the teacher's attention); or 'scratch' (default: embeddings,ffn,wo for "
              "retnet, embeddings,ffn for mamba)")
    keep_softmax: tuple[int, ...] | str = ()  # layer indices, or "xatl": layers 2 and N/2 (the paper's hybrid)
    freeze: str = setting("unfrozen", "transferred weights (default: unfrozen)", choices=("frozen", "unfrozen", "lit"))
    lit_threshold: float = setting(0.01, "LIT: unfreeze when validation improves by less than this (0.01)")
    lit_patience: int = setting(1, "LIT: evaluations below the threshold before unfreezing (1)")

    PAPER: typing.ClassVar[dict] = {"lr": "XATL: 3e-4", "min_lr": "XATL: 3e-5", "warmup_steps": "XATL: 2000",
                                    "weight_decay": "XATL: 0.1"}

    def check(self) -> None:
        from ..convert.xatl_transfer import ARCHITECTURES, resolve_transfer

        if isinstance(self.keep_softmax, str) and self.keep_softmax != "xatl":
            raise LinearizeError(f"keep_softmax {self.keep_softmax!r}: give layer indices (e.g. 2,15) or 'xatl' "
                                 "(layers 2 and N/2)")
        if self.arch not in ARCHITECTURES:  # a recipe file's (the flag has its choices)
            raise LinearizeError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}")
        resolve_transfer(self.transfer, ARCHITECTURES[self.arch], (0,) if self.keep_softmax else ())

    def graphs_blocked(self) -> str | None:
        if self.freeze == "lit" and world_size() > 1:
            return ("under torchrun the step is captured once, before training, and LIT's unfreezing needs a new "
                    "capture (one GPU can graph LIT)")
        return None

    def build(self, teacher):
        from ..convert.xatl_transfer import build_xatl

        keep = self.keep_softmax if self.keep_softmax == "xatl" else (list(self.keep_softmax) or None)
        student, report = build_xatl(teacher, self.arch, transfer=self.transfer, keep_softmax=keep, seed=self.seed)
        return student, [], report

    def callbacks(self) -> list:
        from pathlib import Path

        from .lit import LitCallback

        # the transferred tensors come from the XATL record in the student's config; LIT's unfreezing is a
        # line in the run's metrics.jsonl, and its record goes into results.json (``freeze``)
        return [LitCallback(mode=self.freeze, threshold=self.lit_threshold, patience=self.lit_patience,
                            log_path=str(Path(self.out) / "metrics.jsonl"))]
