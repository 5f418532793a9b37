"""Uptraining, what SUPRA and XATL share: train a student end to end, on the papers' next-token loss
(``loss: lm``, the default) or from the teacher (``loss: kl`` or ``kl+lm``: a frozen copy of the
teacher runs beside the student), optionally after an alignment stage (``align_steps``: each mixer's
output fitted to the teacher's attention output at its layer, teacher-forced, only the mixers
training; RADLADS / MOHAWK step 1). Adam(W) with betas (0.9, 0.95), linear warmup, cosine decay to a
floor.

The recipes are ``recipes.supra`` (the teacher converted in place) and ``recipes.xatl`` (a new
architecture built from the teacher's weights): each a config subclass of ``UptrainConfig``
(``recipes.settings``) with its own settings and its ``build``; ``run`` trains any of them.
"""

from __future__ import annotations

import sys
import time
import typing
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import LinearizeError
from ..eval import perplexity
from ..graphed import use_graphs
from .common import begin_run, finish, phase, phases_line
from .config import resolve_budget
from .settings import UptrainConfig
from ..distill import FrozenTeacher, build_objective, check_options, next_token_loss
if typing.TYPE_CHECKING:
    from .engine import TrainConfig
from .launch import is_main_process, peak_gpu_memory, under_fsdp


def train_config(cfg: UptrainConfig, output_dir: Path, steps: int, warmup: int, lr: float | None = None,
                 eval_next_token: bool = False) -> TrainConfig:
    """The training engine's settings of one stage of ``cfg``'s run: ``steps`` steps, ``warmup`` of them
    warming up, at peak ``lr`` (default ``cfg.lr``)."""
    from .engine import TrainConfig

    return TrainConfig(
        output_dir=str(output_dir), learning_rate=lr or cfg.lr, max_steps=steps, batch_size=cfg.batch_size,
        eval_next_token=eval_next_token,
        grad_accum=cfg.grad_accum, scheduler="cosine_with_min_lr", warmup_steps=warmup,
        weight_decay=cfg.weight_decay, adam_betas=(0.9, 0.95), eval_steps=cfg.eval_steps,
        early_stopping_patience=cfg.patience, save_total_limit=cfg.keep_checkpoints,
        profile_steps=cfg.profile_steps, gradient_checkpointing=cfg.gradient_checkpointing,
        seed=cfg.seed, logging_steps=max(1, min(10, cfg.eval_steps)),
        extra={"lr_scheduler_kwargs": {"min_lr": cfg.min_lr}}, compile=cfg.compile,
        cuda_graph=cuda_graphs(cfg)[0],
    )


BUDGETS = {
    # departures from the papers, named: warmup is 100 steps at the gpu budget (SUPRA's 1000 and
    # XATL's 2000 are sized for runs of 20B+ tokens, not ~20M)
    "cpu": dict(block_len=256, batch_size=2, train_blocks=256, eval_blocks=4, eval_steps=8, steps=16, warmup_steps=2),
    "gpu": dict(block_len=1024, batch_size=8, train_blocks=None, eval_blocks=64, eval_steps=200, steps=2440,
                warmup_steps=100),
}


def apply_budget(cfg: UptrainConfig, budget: str | None) -> UptrainConfig:
    return replace(cfg, **BUDGETS[resolve_budget(budget)])


def learns_from_lm(loss: str) -> bool:
    """``loss`` is the papers' next-token loss alone."""
    return loss.replace(" ", "") in ("lm", "next_token")


def _learns_from_lm(cfg: UptrainConfig) -> bool:
    return learns_from_lm(cfg.loss)


def check_distillation(cfg: UptrainConfig) -> None:
    """The recipe's settings (``cfg.check``), the loss and the alignment stage, checked before the teacher loads."""
    cfg.check()
    if cfg.align_steps < 0:
        raise LinearizeError(f"align_steps must be zero or more, got {cfg.align_steps}")
    if not _learns_from_lm(cfg):
        check_options(cfg.loss, cfg.loss_options())
    cuda_graphs(cfg)  # --cuda-graph on where the steps cannot replay: refused here


def cuda_graphs(cfg: UptrainConfig) -> tuple[bool, str | None]:
    """Whether the training steps of ``cfg``'s run replay as CUDA graphs, and if not, why (under
    ``cuda_graph: auto``): ``linearize.graphed.use_graphs`` on this process's device and launch, the
    loss's terms, ``compile`` and the recipe's own reason (``graphs_blocked``). Raises ``LinearizeError``
    under ``on`` where they cannot."""
    names = [] if _learns_from_lm(cfg) else build_objective(cfg.loss, cfg.loss_options()).uncapturable
    uncapturable = ", ".join(names)
    return use_graphs(cfg.cuda_graph, cuda=torch.cuda.is_available(),
                      uncapturable=f"{uncapturable} in the loss {cfg.loss!r}" if uncapturable else None,
                      fsdp=under_fsdp(), compile=cfg.compile, checkpointing=cfg.gradient_checkpointing,
                      other=cfg.graphs_blocked())


def _align(student, frozen, train_ds, eval_ds, cfg: UptrainConfig, out: Path) -> dict:
    """The alignment stage: only the mixers train, each toward the teacher's attention output at its
    layer on the teacher's hidden states (``mixer_mse``); the rest is restored to trainable after."""
    from ..convert import mixers
    from .engine import train

    trained = {id(p) for m in mixers(student).values() for p in m.parameters()}
    # counted now: under FSDP the Trainer swaps each parameter for its sharded one
    count = sum(p.numel() for p in student.parameters() if id(p) in trained)
    for p in student.parameters():
        p.requires_grad_(id(p) in trained)
    objective = build_objective("mixer_mse", teacher=frozen)
    # eager even under --cuda-graph: the alignment loss runs the student's mixers on the teacher's hidden
    # states, not on the student's own forward (mixer_mse is not capturable)
    stage = replace(train_config(cfg, out / "align", cfg.align_steps, min(cfg.warmup_steps, cfg.align_steps),
                                 cfg.align_lr), cuda_graph=False)
    trainer = train(student, train_ds, eval_ds, objective, stage, stage="align", resume=True if cfg.resume else None,
                    metrics_path=out / "metrics.jsonl")
    for p in student.parameters():
        p.requires_grad_(True)
    return {"steps": trainer.state.global_step, "parameters": count, "speed": trainer.speed}


def run(cfg: UptrainConfig) -> dict:
    check_distillation(cfg)  # e.g. a bad transfer map fails now, not after the teacher and its perplexity
    from .engine import split, train

    graphed, why = cuda_graphs(cfg)
    fsdp = under_fsdp()  # the teacher loads on the CPU, and the student is built there (begin_run)
    out, teacher, tok, train_ds, eval_ds, eval_blocks, results = begin_run(
        cfg, skip_under_fsdp=("perplexity: student, before training",))
    results["cuda_graph"] = {"setting": cfg.cuda_graph, "graphed": graphed, **({"why": why} if why else {})}
    if why and is_main_process():  # auto, and a condition fails: eager
        print(f"linearize: training eagerly, not as CUDA graphs (--cuda-graph auto): {why}", file=sys.stderr)
    # under accelerate's FSDP config the frozen teacher is sharded like the student, its weights on the
    # CPU until then. SUPRA converts the teacher in place: the frozen teacher is a copy made first. XATL
    # builds a new model from the teacher, then freezes the teacher itself (after the build: freezing
    # moves it to the CPU under FSDP, casts it to bf16 on CUDA, neither of which is the student's)
    frozen = None
    from_teacher = bool(cfg.align_steps) or not _learns_from_lm(cfg)
    if from_teacher and cfg.converts_in_place:
        frozen = FrozenTeacher(teacher, copy_model=True, shard=fsdp)
    with phase(results, "build"):
        student, new_parameters, report = cfg.build(teacher)
    if from_teacher and not cfg.converts_in_place:
        frozen = FrozenTeacher(teacher, copy_model=False, shard=fsdp)
    if report is not None:
        results["transfer_report"] = report.summary()
    if not fsdp:  # under FSDP the student waits on the CPU until the Trainer shards it: not measured whole
        with phase(results, "perplexity: students"):
            results["perplexity"]["student, before training"] = perplexity(student, eval_blocks)
    for p in student.parameters():
        p.requires_grad_(True)

    callbacks = cfg.callbacks()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.time()
    steps_done, speeds = 0, []  # speeds: each training stage's set-up / steady record (engine.StepClock)
    if cfg.align_steps:
        results["align"] = _align(student, frozen, train_ds, eval_ds, cfg, out)
        steps_done += results["align"]["steps"]
        speeds.append(results["align"].pop("speed"))
        with phase(results, "perplexity: students"):
            results["perplexity"]["student, after alignment"] = perplexity(student, eval_blocks)
        student = _plain(student)
    if first_steps := cfg.stage_before():
        new_ids = {id(p) for p in new_parameters}
        for p in student.parameters():
            p.requires_grad_(id(p) in new_ids)
        first = train(student, train_ds, eval_ds, next_token_loss,
                      train_config(cfg, out / "new-weights", first_steps, min(cfg.warmup_steps, first_steps)),
                      stage="new-weights", resume=True if cfg.resume else None, metrics_path=out / "metrics.jsonl")
        steps_done += first.state.global_step
        speeds.append(first.speed)
        student = _plain(student)
        for p in student.parameters():
            p.requires_grad_(True)
    lm = _learns_from_lm(cfg)
    objective = next_token_loss if lm else build_objective(cfg.loss, cfg.loss_options(), teacher=frozen)
    results["loss"] = "lm" if lm else repr(objective)
    stage_cfg = train_config(cfg, out / "train", cfg.steps, cfg.warmup_steps, eval_next_token=not lm)
    if any(getattr(c, "mode", None) == "lit" for c in callbacks):  # resumed, LIT's state comes from the checkpoint
        stage_cfg.extra = {**stage_cfg.extra, "restore_callback_states_from_checkpoint": True}  # thawed stays thawed
    trainer = train(student, train_ds, eval_ds, objective, stage_cfg,
                    stage="uptrain", callbacks=callbacks, resume=True if cfg.resume else None,
                    metrics_path=out / "metrics.jsonl")
    steps_done += trainer.state.global_step
    speeds.append(trainer.speed)
    for callback in trainer.callback_handler.callbacks:  # the live ones: a resumed run restores fresh copies
        if hasattr(callback, "record"):  # XATL's freezing schedule: LIT's evaluations and the step it unfroze
            results["freeze"] = callback.record()
    if frozen is not None:  # under FSDP each process held 1/N of the teacher
        results["teacher_sharded_over"] = trainer.args.world_size if frozen.sharded else 1
    seconds = time.time() - start
    tokens = steps_done * cfg.batch_size * cfg.grad_accum * cfg.block_len * trainer.args.world_size
    # the set-up / steady split of every stage together (the rest: evaluations, checkpoints and what runs
    # between the stages, such as the perplexity after alignment)
    results["train"] = {"steps": steps_done, "seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds,
                        "epochs": tokens / max(results["train_tokens_per_epoch"], 1),  # passes over the corpus
                        **split(speeds, seconds)}
    results["train"].update(peak_gpu_memory())  # under FSDP: each GPU's share of the student and the teacher
    results.setdefault("phases", {})["training"] = seconds  # the stages, with what runs between them
    with phase(results, "perplexity: students"):
        results["perplexity"]["student, after training"] = perplexity(student, eval_blocks)
    student = _plain(student, main_only=True)  # only the main process saves and samples it
    del trainer, frozen, objective  # their GPU memory (under FSDP the sharded model, optimizer state) goes before the sample
    return finish(student, tok, out, results, cfg.sample_prompt)


def _plain(student, main_only: bool = False):
    """Between stages and before saving: a student a stage left sharded (FSDP), gathered whole on the
    CPU (every rank takes part), so the next stage's Trainer shards a plain model afresh (it finds no
    decoder layer class in one already sharded) and rank 0 saves and decodes it alone; any other
    student as it is (``engine.unsharded``; ``main_only``: the other ranks keep no copy)."""
    from .engine import unsharded

    return unsharded(student, device="cpu", main_only=main_only)


def summary(results: dict, label: str) -> str:
    from .engine import split_line

    lines = [f"[{label}] held-out perplexity ({results['eval_tokens']:,} tokens)"]
    lines += [f"  {k:<28} {v:10.2f}" for k, v in results["perplexity"].items()]
    if results.get("loss", "lm") != "lm":
        shards = results.get("teacher_sharded_over", 1)
        lines.append(f"  trained on {results['loss']} from a frozen copy of the teacher"
                     + (f" (sharded over {shards} processes)" if shards > 1 else ""))
    if "align" in results:
        lines.append(f"  alignment stage: {results['align']['steps']} steps ({results['align']['parameters']:,} mixer "
                     "parameters fitted to the teacher's attention outputs)")
    t = results["train"]
    lines.append(f"  trained {t['steps']} steps, {t['tokens']:,} tokens ({t['epochs']:.2f} epochs of the corpus) in "
                 f"{t['seconds']:.0f}s ({t['tokens_per_second']:,.0f} tok/s; {split_line(t)})")
    if line := phases_line(results):
        lines.append(line)
    if results.get("sample") is not None:
        lines.append(f"  sample (recurrent decoding): {results['sample']!r}")
    return "\n".join(lines)
