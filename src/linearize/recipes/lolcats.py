"""LoLCATs (Zhang et al., 2024): attention transfer, then low-rank linearizing.

Stage 1 — attention transfer. The teacher is frozen; only the feature maps (and the window weights
gamma) train, so that every converted layer's output matches the teacher's softmax attention on the
same input: MSE between the two outputs of each layer (scaled by ``mse_factor``, 1000 as in the
LoLCATs code), with the teacher's output passed on to the next layer. Jointly over all layers, or
block by block (``layers_per_block = k``; k = 1 is layer by layer), which bounds memory by k layers.
A block trains on the teacher's hidden states entering it, computed once and kept in CPU memory
(LoLCATs §3.3.2; ``block_inputs="recompute"`` runs the earlier layers at every step instead).

Stage 2 — low-rank linearizing. LoRA (r=8, alpha=16 on q/k/v/o by default) trained on next-token
loss; the adapters are merged into the saved checkpoint unless ``merge`` is off.

``keep_softmax: auto:K`` converts every layer for stage 1, then keeps softmax the K layers with the
largest ``auto_softmax_score``: their attention-output MSE after stage 1, or how much their softmax
attention lowers the loss of copying a random span from beyond the window (``auto_softmax_choice``).

``cuda_graph`` (auto by default): each stage's training steps replay as CUDA graphs
(``linearize.graphed``) where the run allows it: stage 1's ``attention_mse`` is captured whole (it
runs the student's forward with its probes itself), stage 2's next-token loss (or ``kl`` from the
student's own softmax view, computed eagerly before each replay) from the LoRA model's forward.
``cuda_graphs`` says, per stage, whether and if not why.

Paper defaults: Hedgehog maps, feature dim 64, window 64, lr 1e-2 (stage 1) and 1e-4 (stage 2),
2 epochs each on 1024-token packs, batch 8, early stopping on the validation loss.
"""

from __future__ import annotations

import gc
import json
import re
import time
import typing
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from .. import convert, mixers
from ..distill import SameModelTeacher, build_objective, check_options, layer_mse, next_token_loss, softmax_view
from ..distill.hooks import StopForward, injecting, layer_input
from ..distill.probes import fully_sharded
from ..errors import LinearizeError
from ..eval import perplexity
from ..graphed import use_graphs
from ..models import get_adapter
from .common import begin_run, finish, phase, phases_line
from .config import resolve_budget
from .settings import AUTO_SCORES, DEFAULT_DATA, DEFAULT_SPEC, LolcatsConfig
if typing.TYPE_CHECKING:
    from .engine import TrainConfig
from .launch import is_main_process, peak_gpu_memory, rank0s, under_fsdp, world_size

__all__ = ["LolcatsConfig", "ablation_config", "cuda_graphs", "layer_mse", "run", "run_stage1", "run_stage2",
           "stage_config", "summary"]

# The comparison rows of LoLCATs Table 5, by name -> (stages, spec changes)
ABLATIONS = {
    "lolcats": (("stage1", "stage2"), {}),
    "swap-finetune": (("stage2",), {}),
    "stage1-only": (("stage1",), {}),
    # no window: a linear student, without the hybrid's own options (features before RoPE, per-key-head gates)
    "no-window": (("stage1", "stage2"), {"kind": "linear", "feature_rope": True, "decay": "none"}),
}


def stage_config(cfg: LolcatsConfig, stage: str, output_dir: Path) -> TrainConfig:
    """The training engine's settings of ``stage`` (``stage1`` or ``stage2``) of ``cfg``'s run."""
    from .engine import TrainConfig

    first = stage == "stage1"
    return TrainConfig(
        cuda_graph=cuda_graphs(cfg, stage)[0],
        eval_next_token=not first and not stage2_learns_from_lm(cfg),
        output_dir=str(output_dir), learning_rate=cfg.stage1_lr if first else cfg.stage2_lr,
        epochs=cfg.stage1_epochs if first else cfg.stage2_epochs,
        max_steps=cfg.stage1_steps if first else cfg.stage2_steps,
        batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, eval_steps=cfg.eval_steps,
        early_stopping_patience=cfg.patience, save_total_limit=cfg.keep_checkpoints,
        profile_steps=cfg.profile_steps, gradient_checkpointing=cfg.gradient_checkpointing,
        seed=cfg.seed, logging_steps=max(1, min(10, cfg.eval_steps)),
    )


def cuda_graphs(cfg: LolcatsConfig, stage: str) -> tuple[bool, str | None]:
    """Whether ``stage``'s (``stage1`` or ``stage2``) training steps replay as CUDA graphs, and if not,
    why (under ``cuda_graph: auto``): ``linearize.graphed.use_graphs`` on this process's device and
    launch, stage 2's loss terms, and what the recipe's settings rule out: block-wise stage 1 fed
    cached inputs (each batch's teacher states enter the block from outside the model). Raises
    ``LinearizeError`` under ``on`` where they cannot."""

    uncapturable = other = None
    if stage == "stage2" and not stage2_learns_from_lm(cfg):
        names = ", ".join(build_objective(cfg.loss, cfg.loss_options()).uncapturable)
        uncapturable = f"{names} in the loss {cfg.loss!r}" if names else None
    if stage == "stage1" and cfg.layers_per_block and cfg.block_inputs == "cache":
        other = ("block-wise stage 1 from cached inputs (--layers-per-block with --block-inputs cache) feeds each "
                 "batch's teacher states into its block from outside the model (--block-inputs recompute can be "
                 "graphed)")
    return use_graphs(cfg.cuda_graph, cuda=torch.cuda.is_available(), uncapturable=uncapturable, fsdp=under_fsdp(),
                      checkpointing=cfg.gradient_checkpointing, other=other)


def _graph_decisions(cfg: LolcatsConfig) -> dict[str, tuple[bool, str | None]]:
    """``cuda_graphs`` of each stage ``cfg`` runs (``on``: raises where one cannot)."""
    return {stage: cuda_graphs(cfg, stage) for stage in ("stage1", "stage2") if stage in cfg.stages}


def _graph_record(cfg: LolcatsConfig, decisions: dict) -> dict:
    """``results["cuda_graph"]``: the setting, and per stage whether it was graphed and if not why;
    under ``auto`` each reason is printed once (one line for the stages it keeps eager)."""
    import sys

    record = {"setting": cfg.cuda_graph}
    reasons: dict[str, list[str]] = {}
    for stage, (graphed, why) in decisions.items():
        record[stage] = {"graphed": graphed, **({"why": why} if why else {})}
        if why:
            reasons.setdefault(why, []).append(stage)
    if is_main_process():
        for why, stages in reasons.items():
            which = "" if len(stages) == len(decisions) else " " + " and ".join(s.replace("stage", "stage ")
                                                                                for s in stages)
            print(f"linearize: training{which} eagerly, not as CUDA graphs (--cuda-graph auto): {why}", file=sys.stderr)
    return record


# --- stage 1 -------------------------------------------------------------------------------------

class _CachedInputs(torch.utils.data.Dataset):
    """Training blocks with the teacher's hidden states entering a block of layers."""

    def __init__(self, blocks: torch.Tensor, hidden: torch.Tensor):
        self.blocks, self.hidden = blocks, hidden

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i], "hidden": self.hidden[i]}


@torch.no_grad()
def _inputs_of(student, layer: torch.nn.Module, blocks: torch.Tensor, batch_size: int, start=None) -> torch.Tensor:
    """The hidden states entering ``layer`` for every block (teacher-forced), on the CPU.

    ``start = (module, hidden)``: begin at ``module`` from those cached states rather than at the
    embeddings (the model's layer list must then begin at ``module``)."""
    device = next(student.parameters()).device
    found, current = [], {}

    def grab(module, args, kwargs):
        found.append(layer_input(args, kwargs).cpu())
        raise StopForward

    handles = [layer.register_forward_pre_hook(grab, with_kwargs=True)]
    if start is not None:
        handles.append(injecting(start[0], current))
    try:
        with softmax_view(student):  # the layers before the block give the teacher's outputs
            for s in range(0, len(blocks), batch_size):
                if start is not None:
                    current["hidden"] = start[1][s : s + batch_size]
                try:
                    student(input_ids=blocks[s : s + batch_size].to(device), use_cache=False)
                except StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()
    return torch.cat(found)


def _feeding(loss_fn, feed):
    def loss(model, batch):
        feed(batch)
        return loss_fn(model, batch)
    return loss


def _keep_layers(layer_list: torch.nn.ModuleList, modules) -> None:
    for key in list(layer_list._modules):
        del layer_list._modules[key]
    for i, module in enumerate(modules):
        layer_list.add_module(str(i), module)


@contextmanager
def _block_from_cache(student, first: int, last: int, train_ds, eval_ds, batch_size: int, previous=None):
    """Layers ``first..last`` alone, fed the teacher's hidden states entering ``first``, computed
    once (LoLCATs §3.3.2): the earlier layers do not run while the block trains. ``previous`` (what
    the previous block yielded as its record) lets those states come from the previous block's
    cached inputs through its layers only, so caching every block costs one teacher forward.
    Yields the datasets with the states, ``feed`` (the loss calls it with each batch) and the record."""
    layer_list = get_adapter(student.config).layers(student)
    saved = list(layer_list)
    entry = saved[first]
    sets = [("train", train_ds), ("eval", eval_ds)]
    if previous is None:
        hidden = {name: _inputs_of(student, entry, ds.blocks, batch_size) for name, ds in sets if ds is not None}
    else:
        start, before = previous[0], previous[1]
        _keep_layers(layer_list, saved[start : first + 1])
        try:
            hidden = {name: _inputs_of(student, entry, ds.blocks, batch_size, start=(saved[start], before[name]))
                      for name, ds in sets if ds is not None}
        finally:
            _keep_layers(layer_list, saved)
    train = _CachedInputs(train_ds.blocks, hidden["train"])
    evals = None if eval_ds is None else _CachedInputs(eval_ds.blocks, hidden["eval"])
    current = {}
    handle = injecting(entry, current)
    _keep_layers(layer_list, saved[first : last + 1])
    try:
        yield train, evals, lambda batch: current.update(hidden=batch["hidden"]), (first, hidden)
    finally:
        handle.remove()
        _keep_layers(layer_list, saved)


def _freeze_all_but(student, layers: set[int]) -> None:
    for p in student.parameters():
        p.requires_grad_(False)
    for i, m in mixers(student).items():
        if i in layers:  # what the conversion added: feature maps, window weights (and a delta rule's gates)
            for _, p in m.new_parameters():
                p.requires_grad_(True)


STAGE1_WEIGHTS = "trained.safetensors"


def _trained_weights(student) -> dict[str, torch.Tensor]:
    """The parameters that require gradients, whole and on the CPU (gathered when FSDP shards them:
    every rank calls this)."""
    from .engine import gathered_state

    names = {n for n, p in student.named_parameters() if p.requires_grad}
    if fully_sharded(student):  # those alone: the whole model on every rank's CPU would not fit a 70B host
        return {n: t.contiguous() for n, t in gathered_state(student, only=names).items()}
    return {n: p.detach().cpu().contiguous() for n, p in student.named_parameters() if n in names}


def _save_trained(trained: dict[str, torch.Tensor], stage_dir: Path) -> None:
    """What a stage-1 block trained (``_trained_weights``) and the random state after it, where
    ``--resume`` finds them: a run stopped after the block goes on from these weights, not from the
    untrained conversion, and draws what the uninterrupted run draws next."""
    from safetensors.torch import save_file

    tmp = stage_dir / (STAGE1_WEIGHTS + ".tmp")
    save_file(trained, str(tmp))
    # the random state too: what follows (stage 2's LoRA initialisation) draws the same numbers after a resume
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save(rng, stage_dir / "rng.pt")
    tmp.replace(stage_dir / STAGE1_WEIGHTS)


def _load_trained(student, stage_dir: Path, kept=()) -> None:
    """What a finished stage-1 block saved (``_save_trained``) into ``student``, and the random state after it.
    ``kept``: layers the student keeps softmax since (``auto:K``), whose trained mixer weights it has no place for."""
    from safetensors.torch import load_file

    path = stage_dir / STAGE1_WEIGHTS
    if not path.exists():
        raise LinearizeError(f"{stage_dir} is marked done but holds no {STAGE1_WEIGHTS} (a run of an older "
                             "linearize); start it again without --resume or in a new --out")
    params = dict(student.named_parameters())
    kept_layer = re.compile(r"(^|\.)layers\.(" + "|".join(str(i) for i in kept) + r")\.") if kept else None
    with torch.no_grad():
        for name, value in load_file(str(path)).items():
            if name not in params and kept_layer is not None and kept_layer.search(name):
                continue
            if name not in params:
                raise LinearizeError(f"{path} holds {name}, which this student does not have: resume with the "
                                     "settings the run started with")
            params[name].copy_(value)
    if (stage_dir / "rng.pt").exists():
        rng = torch.load(stage_dir / "rng.pt", weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda"])


def run_stage1(student, train_ds, eval_ds, cfg: LolcatsConfig, out: Path) -> dict:
    """Train stage 1 (jointly, or block by block); returns its record (``_timed``: steps, seconds, tokens,
    the set-up / steady split, whose set-up counts each block's caching of the teacher's hidden states)."""
    from .engine import StepClock, train

    converted = sorted(mixers(student))
    k = cfg.layers_per_block or len(converted)
    groups = [converted[i : i + k] for i in range(0, len(converted), k)]
    start, steps, speeds = _start_clock(), 0, []
    previous = None  # the previous block's cached inputs, from which the next block's are made
    for b, group in enumerate(groups):
        stage_dir = out / "stage1" / (f"block-{b:02d}" if len(groups) > 1 else "joint")
        if (stage_dir / "done").exists():  # resumed run: this block finished before; take its weights back
            _load_trained(student, stage_dir)
            previous = None
            continue
        clock = StepClock()  # the block's set-up begins: caching the teacher's states entering it, then the Trainer
        _freeze_all_but(student, set(group))
        loss = build_objective("attention_mse", context=dict(layers=tuple(group), mse_factor=cfg.mse_factor,
                                                            xent_factor=cfg.xent_factor))
        with ExitStack() as stack:
            block_train, block_eval = train_ds, eval_ds
            if len(groups) > 1 and cfg.block_inputs == "cache":
                block_train, block_eval, feed, previous = stack.enter_context(
                    _block_from_cache(student, group[0], group[-1], train_ds, eval_ds, cfg.batch_size, previous))
                loss = _feeding(loss, feed)
            if cfg.gradient_checkpointing:  # the probes stay for the backward, where each layer runs again
                from ..distill import transfer_probes

                stack.enter_context(transfer_probes(student, group, with_xent=cfg.xent_factor > 0))
            trainer = train(student, block_train, block_eval, loss, stage_config(cfg, "stage1", stage_dir),
                            stage=f"stage1[{b}]", resume=True if cfg.resume else None,
                            metrics_path=out / "metrics.jsonl", clock=clock)
        steps += trainer.state.global_step
        speeds.append(trainer.speed)
        if trainer.graphed is not None and len(groups) > 1:
            # the block's graphs (a reference cycle): their memory goes before the next block captures its own
            trainer.graphed = None
            gc.collect()
            torch.cuda.empty_cache()
        # under FSDP every rank gathers the trained weights (a collective); the main process writes
        trained = _trained_weights(student)
        if is_main_process():  # the block's weights first, then the mark a resumed run trusts
            _save_trained(trained, stage_dir)
            (stage_dir / "done").write_text("ok\n")
    return _timed({"blocks": len(groups), "steps": steps}, start, cfg, speeds)


def _rebuilt_after_stage1(cfg: LolcatsConfig, out: Path, chosen: list[int] | None = None, spec: dict | None = None,
                          record: dict | None = None):
    """Under FSDP, after stage 1: each process's student made again on the CPU, from the teacher loaded as
    at the start (``common.fsdp_teacher``: a bf16 checkpoint's file pages, shared by the processes; a shape
    teacher drawn again from the run's seed) and what stage 1 trained, which the main process saved for each
    block (``_save_trained``), instead of every process gathering the whole trained student into its own
    memory (141 GB each at 70B). Every process calls it. With ``keep_softmax: auto:K`` the ``chosen`` layers
    are kept softmax (``spec``: their windows too) and ``record`` goes into the config, as
    ``keep_chosen_layers`` does; what stage 1 trained in them is left out."""
    from .common import fsdp_teacher

    torch.distributed.barrier()  # the main process has written every block's weights
    torch.manual_seed(cfg.seed)  # as begin_run, before the teacher loads
    teacher, _ = fsdp_teacher(cfg)
    if chosen is None:
        student = cfg.convert_teacher(teacher)
    else:
        student = convert(teacher, spec, keep_softmax=chosen, inplace=True)
        student.config.linearize = {**student.config.linearize, "auto_softmax": record}
    for stage_dir in sorted(p for p in (out / "stage1").iterdir() if (p / "done").exists()):
        _load_trained(student, stage_dir, kept=chosen or ())
    return student


def _free_gpu() -> None:
    """The sharded stage-1 student's GPU memory back, once nothing names it (FSDP's hooks hold it in cycles)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _start_clock() -> float:
    """A stage's start: its wall clock, and a fresh peak-memory count on CUDA."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return time.time()


def _timed(info: dict, start: float, cfg: LolcatsConfig, speeds: list[dict]) -> dict:
    """Add a stage's wall time, training tokens, tokens/s (tokens over every process; the stage's whole
    wall time), its set-up / steady split (``engine.split`` of its trainings' ``speeds``: ``setup``,
    ``steady``, ``other_seconds``) and, on CUDA, this process's peak allocated memory to ``info``."""
    from .engine import split

    seconds = time.time() - start
    world = world_size()
    tokens = info["steps"] * cfg.batch_size * cfg.grad_accum * cfg.block_len * world
    return {**info, "seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / max(seconds, 1e-9),
            **split(speeds, seconds), **peak_gpu_memory()}


# --- stage 2 -------------------------------------------------------------------------------------

def stage2_learns_from_lm(cfg: LolcatsConfig) -> bool:
    return cfg.loss.replace(" ", "") in ("lm", "next_token")


def _stage2_objective(cfg: LolcatsConfig):
    """Stage 2's loss: the next-token loss, or an objective reading the teacher, which is the student
    itself with softmax attention from its frozen projections and LoRA off (exact, no second model)."""
    if stage2_learns_from_lm(cfg):
        return next_token_loss
    return build_objective(cfg.loss, cfg.loss_options(), teacher=SameModelTeacher())


def run_stage2(student, train_ds, eval_ds, cfg: LolcatsConfig, out: Path):
    from .engine import train
    from .lora import add_lora

    targets = list(cfg.lora_targets or get_adapter(student.config).lora_targets)
    peft_model = add_lora(student, cfg.lora_r, cfg.lora_alpha, targets)
    start = _start_clock()
    trainer = train(peft_model, train_ds, eval_ds, _stage2_objective(cfg), stage_config(cfg, "stage2", out / "stage2"),
                    stage="stage2", resume=True if cfg.resume else None, metrics_path=out / "metrics.jsonl")
    info = _timed({"steps": trainer.state.global_step, "lora_targets": targets,
                   "loss": "lm" if stage2_learns_from_lm(cfg) else cfg.loss}, start, cfg, [trainer.speed])
    if cfg.merge and not fully_sharded(peft_model):  # under FSDP merged after its perplexity (merged_student)
        return peft_model.merge_and_unload(), info
    return peft_model, info


def merged_student(peft_model, cfg: LolcatsConfig, targets: list[str]):
    """Stage 2's student under FSDP: its adapters (on ``targets``) merged into the weights gathered on the
    main process (``lora.merged_from_shards``); any other run's as ``run_stage2`` returned it."""
    from .lora import merged_from_shards

    if not fully_sharded(peft_model):
        return peft_model
    return merged_from_shards(peft_model, cfg.lora_r, cfg.lora_alpha, targets)


# --- automatic softmax layers --------------------------------------------------------------------

def auto_softmax_count(keep) -> int | float | None:
    """K of ``keep_softmax: "auto:K"``, or the share ``F`` of ``"auto:F"`` (``0 < F < 1``: that share of the layers
    the spec converts, ``auto_softmax_layers``), None for explicit layer indices."""
    if not isinstance(keep, str):
        return None
    text = keep.strip()
    if not text.startswith("auto:"):
        return None
    try:
        return max(int(text[5:]), 0) or _bad_auto(keep)
    except ValueError:
        try:
            share = float(text[5:])
        except ValueError:
            share = 0.0
    return share if 0 < share < 1 else _bad_auto(keep)


def _bad_auto(keep):
    raise LinearizeError(f"keep_softmax auto:K needs a positive whole K, or a share of the converted layers between "
                         f"0 and 1 (auto:0.45), got {keep!r}")


def auto_softmax_layers(request: int | float, n_converted: int) -> int:
    """How many layers ``auto:K`` keeps of ``n_converted``: K, or a share of them rounded (at least one), so a
    recipe's ``auto:0.45`` travels between models of different depths."""
    return request if isinstance(request, int) else max(1, round(request * n_converted))


def choose_worst(scores: dict[int, float], k: int) -> list[int]:
    """The ``k`` layers with the largest scores (ties: the lower index), in layer order."""
    return sorted(sorted(scores, key=lambda i: (-scores[i], i))[:k])


RECALL_SEQUENCES = 8  # copy-task sequences the recall score runs (one batch on a GPU)
RECALL_SPAN = 64  # tokens of the copied span (fewer when the distance is shorter)
RECALL_TOKENS = 8  # a recall forward may run this many times a training step's tokens: it keeps no activations


def recall_rows(cfg: LolcatsConfig, length: int) -> int:
    """Copy-task rows one forward of the recall score runs: ``RECALL_TOKENS`` times a training step's tokens
    (``batch_size`` x ``block_len``) in rows of ``length``, at least ``batch_size``, at most every row.
    A forward without gradients keeps no activations; at 1 x 8,192 a step, rows of 1,088 went one at a
    time and the default's choice took 123 of an 8B run's 340 s."""
    budget = RECALL_TOKENS * cfg.batch_size * cfg.block_len // max(length, 1)
    return max(cfg.batch_size, min(RECALL_SEQUENCES, budget))


def recall_distance(cfg: LolcatsConfig) -> int:
    """The recall score's copy distance: ``auto_softmax_distance``, else 4 x the spec's window (256
    for LoLCATs' 64), which puts every copied token's first occurrence beyond the window: only the
    linear state, or a softmax layer, can bring it back."""
    from ..spec import Spec

    return cfg.auto_softmax_distance or 4 * Spec.coerce(cfg.spec).window


def copy_task(tokenizer, vocab_rows: int, distance: int, sequences: int = RECALL_SEQUENCES,
              span: int = RECALL_SPAN, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The recall score's task: ``sequences`` rows of random tokens from the tokenizer's regular ids
    (below its vocabulary size and the model's ``vocab_rows`` embeddings, special tokens left out),
    in which the first ``min(span, distance)`` tokens come again ``distance`` tokens later (random
    tokens between). Returns ``(ids, labels)``, both ``[sequences, distance + span]``: the labels are
    the copy's tokens but its first (which nothing predicts), -100 elsewhere, so a model predicts
    each labelled token by finding its first occurrence ``distance`` tokens back (an induction
    copy). The same ``seed`` draws the same task."""
    span = min(span, distance)
    special = set(tokenizer.all_special_ids)
    regular = torch.tensor([i for i in range(min(tokenizer.vocab_size, vocab_rows)) if i not in special])
    if len(regular) == 0:
        raise LinearizeError("the recall score needs regular token ids, and this tokenizer has only special ones")
    draw = torch.randint(len(regular), (sequences, distance + span), generator=torch.Generator().manual_seed(seed))
    ids = regular[draw]
    ids[:, distance:] = ids[:, :span]
    labels = torch.full_like(ids, -100)
    labels[:, distance + 1 :] = ids[:, distance + 1 :]
    return ids, labels


@torch.no_grad()
def copy_loss(model, ids: torch.Tensor, labels: torch.Tensor, softmax_layers=(), batch_size: int = 8, *,
              layer_outputs=None, resume_at: int = 0, record: bool = False, head="find") -> float:
    """Mean next-token cross-entropy of ``model`` on the labelled tokens of ``copy_task``, with the
    converted layers in ``softmax_layers`` giving the teacher's softmax attention (``SoftmaxAttention``
    from their own projections, which are the teacher's: the attention ``keep_chosen_layers`` keeps)
    and every other converted layer its own mixer. The model's mixers are back afterwards. Runs
    ``batch_size`` rows at a time. ``head``: ``eval.perplexity.output_head``'s ``(trunk, head)`` for
    ``model`` (``"find"``: looked for here; None: none): the output layer then runs on the labelled
    positions alone (a large vocabulary's logits for every position would cap a chunk at a row or two
    of ``LOGIT_BUDGET``); without one, the whole forward, fewer rows where their logits would pass it.
    ``layer_outputs`` (``distill.probes.LayerOutputs`` of ``model``, on these ``ids``): each chunk of rows
    resumes at layer ``resume_at`` from the outputs recorded for it (the layers before it must be as they
    were then), and with ``record`` records its layers' outputs for later calls."""
    from contextlib import nullcontext

    from ..distill.probes import SoftmaxAttention, swapped
    from ..eval.perplexity import LOGIT_BUDGET, output_head

    device = next(model.parameters()).device
    if head == "find":
        head = output_head(model, ids[:1, :8].to(device))
    rows = batch_size if head is not None else max(1, min(batch_size, LOGIT_BUDGET // (
        ids.shape[1] * model.config.get_text_config().vocab_size)))
    restored = set(softmax_layers)
    total, count = 0.0, 0
    with swapped(model, lambda m: SoftmaxAttention(m) if m.layer_idx in restored else None):
        for s in range(0, len(ids), rows):
            target = labels[s : s + rows, 1:].to(device)
            real = target != -100
            resumed = layer_outputs.resuming(s, resume_at) if layer_outputs and resume_at else nullcontext()
            kept = layer_outputs.recording(s) if layer_outputs and record else nullcontext()
            with resumed, kept:
                part = ids[s : s + rows].to(device)
                if head is None:
                    logits = model(input_ids=part, use_cache=False).logits[:, :-1][real]
                else:
                    trunk, output = head
                    logits = output(trunk(input_ids=part, use_cache=False).last_hidden_state[:, :-1][real])
            total += torch.nn.functional.cross_entropy(logits.double(), target[real], reduction="sum").item()
            count += int(real.sum())
            del logits
    return total / count


def auto_long_request(text) -> tuple[int | float, int] | None:
    """``auto_softmax_long``'s ``N@W2`` as ``(N or a share of the chosen layers, W2)``; None when unset."""
    if text in (None, ""):
        return None
    n, _, width = str(text).replace(" ", "").partition("@")
    try:
        return auto_softmax_count(f"auto:{n}"), int(width)
    except (LinearizeError, ValueError):
        raise LinearizeError(f"auto_softmax_long must be N@W2 (N of the chosen layers, or a share 0 < N < 1 of them, "
                             f"over W2 tokens), got {text!r}") from None


def recall_choice(student, ids: torch.Tensor, labels: torch.Tensor, k: int, batch_size: int = 8,
                  candidates: list[int] | None = None):
    """The ``k`` converted layers whose softmax attention most lowers ``copy_loss``, chosen greedily:
    each round scores every layer not yet chosen by the loss with the layers chosen so far softmax
    minus the loss with that layer softmax too, and takes the largest (ties: the lower index). The
    first round's scores are each layer's gain alone (every other layer linear); later rounds see
    the earlier choices, so a second layer that only repeats what the first restores scores low.
    Costs 1 + k x (layers) forwards of ``ids``, each from the layer it changes on: every layer's output in
    the round's own forward (the layers chosen so far softmax) is kept (``LayerOutputs``), and a candidate's
    forward takes the layers before it from there (about half the layers' compute; the same losses), as does
    the next round's, which records again. Returns (chosen, in layer order; the rounds:
    the layers softmax before it, their loss and every candidate's score). ``candidates``: the layers it
    chooses among (default: every converted one)."""
    from ..distill.probes import root_unsharded

    with root_unsharded(student):  # under FSDP: the embeddings and the head whole, for the trunk and head calls
        return _recall_choice(student, ids, labels, k, batch_size, candidates)


def _recall_choice(student, ids, labels, k, batch_size, candidates):
    from tqdm.auto import tqdm

    from ..distill.probes import LayerOutputs
    from ..eval.perplexity import output_head

    candidates = sorted(candidates if candidates is not None else mixers(student))
    chosen: list[int] = []
    outputs = LayerOutputs(student)
    head = output_head(student, ids[:1, :8].to(next(student.parameters()).device))  # found once for every forward
    loss = copy_loss(student, ids, labels, (), batch_size, layer_outputs=outputs, record=True, head=head)
    rounds = []
    total = sum(len(candidates) - r for r in range(k))
    progress = tqdm(total=total, desc=f"choosing {k} of {len(candidates)} layers", unit="copy", leave=False,
                    disable=not is_main_process())  # under a launcher every process scores: one bar
    for r in range(k):
        losses = {}
        for i in candidates:
            if i not in chosen:
                losses[i] = copy_loss(student, ids, labels, chosen + [i], batch_size, layer_outputs=outputs,
                                      resume_at=i, head=head)
                progress.update()
        gains = {i: loss - v for i, v in losses.items()}
        best = choose_worst(gains, 1)[0]
        rounds.append({"softmax": list(chosen), "loss": loss, "scores": {str(i): v for i, v in gains.items()}})
        chosen.append(best)
        loss = losses[best]
        if r + 1 < k:  # the next round's layer outputs: the same before ``best``
            copy_loss(student, ids, labels, chosen, batch_size, layer_outputs=outputs, resume_at=best, record=True,
                      head=head)
    progress.close()
    return sorted(chosen), rounds


def auto_softmax_choice(student, tokenizer, mse: dict[int, float], k: int, cfg: LolcatsConfig):
    """Which ``k`` layers ``keep_softmax: auto:K`` keeps, by ``cfg.auto_softmax_score``: ``mse`` the
    largest attention-output MSE after stage 1 (``mse``, by layer), ``recall`` the greedy gains on
    ``copy_task`` (``recall_choice``; the task drawn from ``cfg.seed``, so a run chooses again as it
    chose). Returns (chosen, record); the record's ``score`` names the score, ``scores`` holds every
    layer's (recall: the first round's, ``rounds`` all of them)."""
    if cfg.auto_softmax_score == "mse":
        chosen = choose_worst(mse, k)
        return chosen, {"k": k, "chosen": chosen, "score": "mse: attention-output MSE after stage 1, the largest kept",
                        "scores": {str(i): float(v) for i, v in sorted(mse.items())}}
    distance = recall_distance(cfg)
    rows = student.get_input_embeddings().num_embeddings
    ids, labels = copy_task(tokenizer, rows, distance, seed=cfg.seed)
    chosen, rounds = recall_choice(student, ids, labels, k, recall_rows(cfg, ids.shape[1]))
    return chosen, {"k": k, "chosen": chosen,
                    "score": f"recall: the loss of copying a random span {distance} tokens back, every layer "
                             "linear, minus that with the layer softmax; the largest kept, greedily",
                    "scores": rounds[0]["scores"], "rounds": rounds,
                    "copy_task": {"sequences": len(ids), "span": min(RECALL_SPAN, distance), "distance": distance,
                                  "seed": cfg.seed, "loss_every_layer_linear": rounds[0]["loss"]}}


def auto_long_choice(student, tokenizer, chosen: list[int], cfg: LolcatsConfig) -> tuple[list[int], dict]:
    """Which of the ``chosen`` layers take ``auto_softmax_long``'s longer window ``W2``: greedily, those whose
    softmax most lowers the loss of copying a span ``W2 - RECALL_SPAN`` tokens back (``recall_choice`` among
    them alone, a task drawn from ``cfg.seed + 1``). Returns (those layers, their record)."""
    request, width = auto_long_request(cfg.auto_softmax_long)
    n = min(auto_softmax_layers(request, len(chosen)), len(chosen))  # a count past a share-chosen K: all of them
    distance = width - RECALL_SPAN
    rows = student.get_input_embeddings().num_embeddings
    ids, labels = copy_task(tokenizer, rows, distance, seed=cfg.seed + 1)
    long, rounds = recall_choice(student, ids, labels, n, recall_rows(cfg, ids.shape[1]), candidates=chosen)
    return long, {"window": width, "k": n, "chosen": long, "distance": distance, "scores": rounds[0]["scores"],
                  "rounds": rounds,
                  "score": f"recall among the kept layers: the loss of copying a random span {distance} tokens back, "
                           "every layer linear, minus that with the layer softmax; the largest kept, greedily"}


def keep_chosen_layers(teacher, trained, chosen: list[int], spec: dict, record: dict):
    """The student with the ``chosen`` layers kept as the teacher's softmax attention and every other
    layer as ``trained`` left it: ``teacher`` is converted in place with those layers kept and takes
    ``trained``'s weights (the same keys: mixers adopt the teacher's projections under their names).
    ``record`` (``auto_softmax_choice``'s: the score, every layer's, the choice) goes into the
    checkpoint's config (``linearize.auto_softmax``)."""
    student = convert(teacher, spec, keep_softmax=chosen, inplace=True)
    source = trained.state_dict()
    target = student.state_dict()
    missing = sorted(set(target) - set(source))
    if missing:
        raise LinearizeError(f"auto softmax layers: the trained student lacks {missing[:3]}")
    student.load_state_dict({name: source[name] for name in target}, strict=True)
    student.config.linearize = {**student.config.linearize, "auto_softmax": record}
    return student


# --- the whole recipe ----------------------------------------------------------------------------

def run(cfg: LolcatsConfig) -> dict:
    """Both stages on ``cfg.teacher``; writes ``out/final`` (a standalone checkpoint) and ``out/results.json``."""
    unknown = set(cfg.stages) - {"stage1", "stage2"}
    if unknown or not cfg.stages:
        raise LinearizeError(f"stages must be a non-empty subset of stage1, stage2; got {list(cfg.stages)}")
    if "stage2" in cfg.stages and not stage2_learns_from_lm(cfg):
        check_options(cfg.loss, cfg.loss_options())
    if "stage2" in cfg.stages and under_fsdp() and not cfg.merge:
        raise LinearizeError("merge: false keeps stage 2's LoRA adapters apart, which a run under FSDP does not "
                             "save; under FSDP the adapters are merged into the saved student")
    if cfg.layers_per_block and under_fsdp():
        raise LinearizeError("block-wise stage 1 (--layers-per-block) runs on one GPU or data-parallel (torchrun); "
                             "under FSDP train every layer jointly (leave --layers-per-block out)")
    auto_k = auto_softmax_count(cfg.keep_softmax)
    if cfg.auto_softmax_score not in AUTO_SCORES:
        raise LinearizeError(f"auto_softmax_score must be one of {', '.join(AUTO_SCORES)}, "
                             f"got {cfg.auto_softmax_score!r}")
    if cfg.auto_softmax_score != "mse" and not auto_k:
        raise LinearizeError(f"auto_softmax_score {cfg.auto_softmax_score} chooses the layers of keep_softmax auto:K, "
                             "which this run does not ask for")
    distance = cfg.auto_softmax_distance
    if distance is not None and (isinstance(distance, bool) or not isinstance(distance, int) or distance < 2):
        raise LinearizeError(f"auto_softmax_distance must be a whole number of tokens, 2 or more, got {distance!r}")
    from ..spec import Spec

    long = auto_long_request(cfg.auto_softmax_long)
    if long and not auto_k:
        raise LinearizeError("auto_softmax_long gives some of the layers keep_softmax auto:K chooses a longer window; "
                             "this run does not ask for auto:K")
    if long and not 0 < Spec.coerce(cfg.spec).softmax_window < long[1] - RECALL_SPAN:
        raise LinearizeError(f"auto_softmax_long {cfg.auto_softmax_long}: the longer window must pass the kept layers' "
                             f"softmax_window (given: {Spec.coerce(cfg.spec).softmax_window}; 0 sees everything) by "
                             f"more than the {RECALL_SPAN}-token span it is chosen to copy")
    if long and isinstance(auto_k, int) and isinstance(long[0], int) and long[0] > auto_k:
        raise LinearizeError(f"auto_softmax_long {cfg.auto_softmax_long} asks for more layers than auto:{auto_k} keeps")
    if auto_k and Spec.coerce(cfg.spec).softmax_windows:
        raise LinearizeError("softmax_window gives layers windows of their own, but keep_softmax auto:K has not "
                             "chosen its layers yet: name the kept layers (--keep-softmax I,J,...) or give one window "
                             "for all (--auto-softmax-long gives the chosen a longer one)")
    if auto_k and "stage1" not in cfg.stages:
        raise LinearizeError("keep_softmax auto:K picks the layers by their attention-transfer error: it needs stage 1")
    decisions = _graph_decisions(cfg)  # --cuda-graph on where a stage cannot replay: refused here
    fsdp = under_fsdp()
    # under FSDP the teacher loads on the CPU and is converted there; nothing is measured before stage 1
    out, teacher, tok, train_ds, eval_ds, eval_blocks, results = begin_run(
        cfg, skip_under_fsdp=("perplexity: converted", "layer_mse_before"))
    ppl = results["perplexity"]
    results["cuda_graph"] = _graph_record(cfg, decisions)
    # auto:K: every layer the spec converts is converted for stage 1; the teacher stays whole to keep the chosen
    # layers from (under FSDP it is loaded again for that: a copy in every process would not fit at 70B)
    with phase(results, "convert"):
        student = cfg.convert_teacher(teacher, inplace=not auto_k or fsdp)
    if auto_k:
        auto_k = auto_softmax_layers(auto_k, n_converted := len(mixers(student)))
    if auto_k and auto_k >= n_converted:
        raise LinearizeError(f"keep_softmax {cfg.keep_softmax} would keep softmax in every one of the {n_converted} "
                             "layers this spec converts (layers with their own sliding window stay as they are under "
                             "keep_sliding); ask for fewer")
    if not fsdp:
        with phase(results, "perplexity: students"):
            ppl["converted"] = perplexity(student, eval_blocks)
    if "stage1" in cfg.stages:
        if not fsdp:
            with phase(results, "attention MSE"):
                results["layer_mse_before"] = layer_mse(student, eval_blocks)
        with phase(results, "stage 1"):
            results["stage1"] = run_stage1(student, train_ds, eval_ds, cfg, out)
        # under FSDP (stage 1 alone, no auto:K) measured on the sharded student, every rank taking part
        with phase(results, "attention MSE"):
            results["layer_mse_after"] = layer_mse(student, eval_blocks)
        if auto_k:
            with phase(results, "perplexity: students"):
                ppl["after_stage1, every layer linear"] = perplexity(student, eval_blocks)
            with phase(results, "softmax layers' choice"):
                # each rank scores the layers; all keep the main process's choice (``rank0s``)
                chosen, results["auto_softmax"] = rank0s(auto_softmax_choice(
                    student, tok, results["layer_mse_after"], auto_k, cfg))
                spec = dict(cfg.spec)
                if cfg.auto_softmax_long:
                    long, results["auto_softmax"]["long"] = rank0s(auto_long_choice(student, tok, chosen, cfg))
                    spec["softmax_windows"] = {i: results["auto_softmax"]["long"]["window"] for i in long}
                if fsdp:  # every process: the student again, from the teacher's files and stage 1's (no gather)
                    student = teacher = None  # the sharded stage-1 student (the teacher converted in place)
                    _free_gpu()
                    student = _rebuilt_after_stage1(cfg, out, chosen, spec, results["auto_softmax"])
                else:
                    student = keep_chosen_layers(teacher, student, chosen, spec, results["auto_softmax"])
        del teacher
        if fsdp and auto_k:  # made again above: whole on the CPU, first sharded by stage 2's training
            results.setdefault("skipped", {})["perplexity: after_stage1"] = (
                "under FSDP the student with the chosen softmax layers is made again on the CPU after stage 1, "
                "whole, and is first sharded by stage 2's training (its perplexity: after_stage2)")
        else:
            with phase(results, "perplexity: students"):
                ppl["after_stage1"] = perplexity(student, eval_blocks)
            if fsdp and "stage2" in cfg.stages:  # every process: the student again, from files (no gather)
                student = _rebuilt_after_stage1(cfg, out)
                _free_gpu()
            elif fsdp:  # gathered whole on the CPU alone, where rank 0 saves it and decodes the sample (finish)
                from .engine import unsharded

                student = unsharded(student, device="cpu", main_only=True)
        _plot_layer_mse(results, out)
    if "stage2" in cfg.stages:
        with phase(results, "stage 2"):
            student, results["stage2"] = run_stage2(student, train_ds, eval_ds, cfg, out)
        with phase(results, "perplexity: students"):  # under FSDP on the sharded student, every rank taking part
            ppl["after_stage2"] = perplexity(student, eval_blocks)
        student = merged_student(student, cfg, results["stage2"]["lora_targets"])
    stages = [results[s] for s in ("stage1", "stage2") if s in results]
    seconds = sum(s["seconds"] for s in stages)
    tokens = sum(s["tokens"] for s in stages)
    results["train"] = {"steps": sum(s["steps"] for s in stages), "seconds": seconds, "tokens": tokens,
                        "tokens_per_second": tokens / max(seconds, 1e-9),
                        "epochs": tokens / max(results["train_tokens_per_epoch"], 1),  # passes over the corpus
                        **_both_stages(stages, seconds)}
    return finish(student, tok, out, results, cfg.sample_prompt)


def _both_stages(stages: list[dict], seconds: float) -> dict:
    """The set-up / steady split of both stages together (each stage's ``setup`` and ``steady`` added up)."""
    from .engine import split

    return split([{"seconds": s["seconds"], "setup": s["setup"], "steady": s["steady"]} for s in stages], seconds)


def _plot_layer_mse(results: dict, out: Path) -> None:
    """out/layer_mse.png when matplotlib is installed (the figures are in results.json regardless)."""
    if not is_main_process() or "layer_mse_before" not in results:  # under FSDP: not measured before stage 1
        return
    try:
        from ..eval.plots import layer_mse_plot
    except ImportError:
        return
    (out / "layer_mse.json").write_text(json.dumps({k: results[k] for k in ("layer_mse_before", "layer_mse_after")}))
    try:
        layer_mse_plot(out / "layer_mse.json", out / "layer_mse.png")
    except LinearizeError:
        pass  # no matplotlib


def ablation_config(cfg: LolcatsConfig, row: str) -> LolcatsConfig:
    """The config of one comparison row (LoLCATs Table 5) at the same token budget."""
    if row not in ABLATIONS:
        raise LinearizeError(f"unknown ablation row {row!r}; choose from {', '.join(ABLATIONS)}")
    stages, spec_changes = ABLATIONS[row]
    return replace(cfg, stages=stages, spec={**cfg.spec, **spec_changes}, out=str(Path(cfg.out) / row))


BUDGETS = {
    # a few minutes of training on 2 CPU cores (make demo): every stage at work, not a converged model
    # (from 40 to 80 stage-1 steps the attention MSE falls 15 %, from 20 to 40 stage-2 steps the loss 0.02 nats)
    "cpu": dict(block_len=256, batch_size=2, train_blocks=256, eval_blocks=4, eval_steps=40, patience=None,
                stage1_steps=40, stage2_steps=12),
    # one GPU, ~10M tokens per stage at 4,096-token packs (2 x 4096 x 1220 steps) of the books, code and WordNet
    # (docs/RESULTS.md, "Across domains"; with no --config the command adds settings.DEFAULT_CONFIG's kept window
    # layers); the paper's 1,024-token packs, 20M tokens per stage and books: --config lolcats_plain
    "gpu": dict(block_len=4096, batch_size=2, train_blocks=None, eval_blocks=64, eval_steps=200, patience=3,
                stage1_steps=1220, stage2_steps=1220, data=DEFAULT_DATA),
    # LoLCATs: 2 epochs per stage over the whole corpus, early stopping
    "paper": dict(block_len=1024, batch_size=8, train_blocks=None, eval_blocks=64, eval_steps=200, patience=3,
                  stage1_steps=-1, stage2_steps=-1),
}


def apply_budget(cfg: LolcatsConfig, budget: str | None) -> LolcatsConfig:
    """A token-budget preset; ``None`` picks gpu on CUDA and cpu otherwise."""
    return replace(cfg, **BUDGETS[resolve_budget(budget)])


def summary(results: dict, row: str = "lolcats") -> str:
    from .engine import split_line

    ppl = results["perplexity"]
    names = {"teacher": "teacher (softmax)", "converted": "converted, before training",
             "after_stage1": "after stage 1 (attention transfer)", "after_stage2": "after stage 2 (LoRA)"}
    lines = [f"[{row}] held-out perplexity ({results['eval_tokens']:,} tokens)"]
    lines += [f"  {names.get(k, k):<36} {v:10.2f}" for k, v in ppl.items()]
    for stage in ("stage1", "stage2"):
        if stage in results:
            r = results[stage]
            peak = f", peak {r['peak_gpu_bytes'] / 2**30:.2f} GiB" if "peak_gpu_bytes" in r else ""
            lines.append(f"  {stage}: {r['steps']} steps, {r['tokens']:,} tokens in {r['seconds']:.0f}s "
                         f"({r['tokens_per_second']:,.0f} tok/s{peak}; {split_line(r)})")
    if "auto_softmax" in results:
        a = results["auto_softmax"]
        lines.append(f"  softmax kept at layers {a['chosen']} (auto:{a['k']} by {a['score']})")
        if "long" in a:
            long = a["long"]
            lines.append(f"  of those, {long['chosen']} over {long['window']} tokens (by {long['score']})")
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    if "layer_mse_before" in results:
        b, a = results["layer_mse_before"], results["layer_mse_after"]
        lines.append(f"  attention MSE, mean over layers: {mean(b):.3g} -> {mean(a):.3g}")
    elif results.get("layer_mse_after"):  # under FSDP nothing is measured before stage 1
        lines.append(f"  attention MSE, mean over layers, after stage 1: {mean(results['layer_mse_after']):.3g}")
    if line := phases_line(results):
        lines.append(line)
    if results.get("sample") is not None:
        lines.append(f"  sample (recurrent decoding): {results['sample']!r}")
    return "\n".join(lines)
