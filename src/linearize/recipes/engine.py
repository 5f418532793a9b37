"""One training engine for every recipe: the Hugging Face Trainer, driven by a method's loss.

A recipe supplies the model (with ``requires_grad`` set on what it trains), datasets of packed
blocks, a ``loss_fn(model, batch) -> scalar`` (a ``linearize.distill`` objective) and callbacks. A NaN/inf loss stops the run with one
line before the step's update, so the last checkpoint stays good. The Trainer brings precision (bf16 on
CUDA, fp32 on CPU), gradient accumulation, checkpoints and resume, a progress bar, logging,
seeds, early stopping and multi-GPU through ``accelerate launch`` / ``torchrun``.

A ``StepClock`` splits each stage's time into set-up (what comes before its steps, and its first
``setup_steps`` steps: graph capture, compilation, kernel autotuning) and steady state (the later steps
alone); ``split`` adds the records of several stages up.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments

from ..distill import next_token_loss
from ..distill.probes import unwrap
from ..errors import LinearizeError
from ..quiet import transient_bars
from .launch import is_main_process, under_fsdp, world_size

__all__ = ["JsonlLogger", "LossFn", "RecipeTrainer", "StepClock", "TrainConfig", "average_gradients",
           "is_main_process", "next_token_loss", "split", "train", "training_arguments"]

LossFn = Callable[[torch.nn.Module, dict], torch.Tensor]


@dataclass
class TrainConfig:
    """What the engine needs from a recipe stage; everything else is the Trainer's default."""

    output_dir: str
    learning_rate: float
    epochs: float = 1.0
    max_steps: int = -1  # > 0 overrides epochs
    batch_size: int = 8  # per device
    grad_accum: int = 1
    scheduler: str = "constant"  # any transformers scheduler name: constant, cosine, linear ...
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    eval_steps: int = 50
    save_steps: int | None = None  # default: eval_steps (early stopping needs them aligned)
    early_stopping_patience: int | None = None
    # also log the validation next-token loss (eval_next_token) where the training loss is another
    # (kl, hidden_mse): curves of runs trained on different objectives stay comparable
    eval_next_token: bool = False
    logging_steps: int = 10
    seed: int = 0
    bf16: bool | None = None  # None: bf16 on CUDA, fp32 elsewhere
    compile: bool = False  # torch.compile the model (TrainingArguments.torch_compile)
    cuda_graph: bool = False  # steps replayed as CUDA graphs (linearize.graphed; a recipe's auto/on/off: use_graphs)
    setup_steps: int = 2  # the first optimizer steps counted as set-up, not steady state (StepClock)
    save_total_limit: int = 2  # resumable checkpoints kept; 0: none written (and no early stopping)
    profile_steps: int = 0  # > 0: that many steps after the set-up run under torch.profiler (StepProfiler)
    gradient_checkpointing: bool = False  # each decoder layer recomputed in the backward (checkpointed_layers)
    extra: dict = field(default_factory=dict)  # passed straight to TrainingArguments


class JsonlLogger(TrainerCallback):
    """Appends every logged metric (loss, eval_loss, lr, ...) as one JSON line to ``metrics.jsonl``,
    with ``elapsed_s``, the wall time since the stage's training began: tokens/s between two lines
    leaves out the first steps' warm-up (kernel compilation, allocator growth)."""

    def __init__(self, path: Path, stage: str):
        self.path, self.stage = path, stage
        self.start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            elapsed = round(time.time() - self.start, 3) if self.start is not None else None
            with self.path.open("a") as fh:
                fh.write(json.dumps({"stage": self.stage, "step": state.global_step, **logs,
                                     "elapsed_s": elapsed}) + "\n")


def process_device() -> torch.device:
    """This process's device: its GPU (under torchrun / accelerate launch, the one it was given), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class StepProfiler(TrainerCallback):
    """Profiles ``steps`` optimizer steps of a stage, those after its first ``after`` (the set-up: compilation,
    graph capture, the allocator's growth), under ``torch.profiler`` on the main process, and writes ``path``
    (JSON) and a table to stdout: the kernels by device time (operators on the CPU) and launches a step, how
    long the GPU was busy against the profiled span (a step that waits on the host, or on another GPU's
    collective, shows there), the host's CUDA runtime calls, and the wall time a step. Under FSDP the
    collectives are kernels too (``nccl...``), so the table says what a sharded step spends on communication
    that the GPU does not hide. Profiled steps run slower than the others and count in the stage's tok/s: use
    it in a run that measures nothing else. A stage that ends before the last profiled step reports the
    steps it profiled."""

    def __init__(self, steps: int, after: int, path: Path, stage: str, top: int = 30):
        self.steps, self.after, self.path, self.stage, self.top = steps, after, Path(path), stage, top
        self.count, self.prof, self.began = 0, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.after == 0:
            self._start(state)

    def on_step_end(self, args, state, control, **kwargs):
        self.count += 1
        if self.prof is None and self.count == self.after:
            self._start(state)
        elif self.prof is not None and self.count == self.after + self.steps:
            self._stop(self.steps)

    def on_train_end(self, args, state, control, **kwargs):
        if self.prof is not None:
            self._stop(self.count - self.after)

    def _start(self, state) -> None:
        if not state.is_world_process_zero:
            return
        from torch.profiler import profile

        from ..profiling import activities

        device = process_device()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.prof = profile(activities=activities(device))
        self.prof.__enter__()
        self.began = time.perf_counter()

    def _stop(self, steps: int) -> None:
        from ..profiling import gpu_busy, kernel_table, runtime_calls

        device = process_device()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - self.began
        self.prof.__exit__(None, None, None)
        prof, self.prof = self.prof, None
        if steps <= 0:
            return
        record = {"stage": self.stage, **kernel_table(prof, device, steps, self.top),
                  "wall_us_per_step": 1e6 * wall / steps, "after_steps": self.after, "world_size": world_size()}
        if device.type == "cuda":
            busy, span = gpu_busy(prof)
            record.update(gpu_busy_us_per_step=busy / steps, profiled_span_us_per_step=span / steps,
                          runtime=runtime_calls(prof, steps)[:12])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record, indent=1))
        print(self.table(record), flush=True)

    @staticmethod
    def table(record: dict) -> str:
        """The record as lines: the head, the largest kernels, the GPU's busy share."""
        from ..profiling import table_lines

        lines = [f"profile of {record['stage']}: {record['steps']} steps after {record['after_steps']}, "
                 f"{record['wall_us_per_step'] / 1000:.2f} ms a step, {record['us_per_step'] / 1000:.2f} ms of "
                 f"{record['unit']} time in {record['launches_per_step']:.0f} launches",
                 *table_lines(record["unit"], record["top"])]
        if record.get("profiled_span_us_per_step"):
            lines.append(f"GPU busy {record['gpu_busy_us_per_step'] / 1000:.2f} ms of a "
                         f"{record['profiled_span_us_per_step'] / 1000:.2f} ms profiled span per step")
        return "\n".join(lines)


class StepClock(TrainerCallback):
    """Splits a training stage's wall time into set-up, steady state and the rest, read from ``now``
    (``time.perf_counter``; a test gives a fake clock). Made when the stage begins (``train`` makes one
    unless given it: a recipe makes its own before the work it counts as the stage's, such as caching
    the teacher's hidden states for a block of LoLCATs stage 1).

    - set-up: from the clock's making to the end of the stage's first ``setup_steps`` optimizer steps:
      caching the teacher's states, building the Trainer, capturing CUDA graphs (first step), compiling,
      fla's autotuning, the optimizer's state and the allocator's growth (first steps);
    - steady state: each later step, from the end of what came before it (the previous step, or the log
      line, evaluation or checkpoint written after it) to its end: loading its batches, forward, backward,
      the optimizer's update (the loss's NaN check reads it every step, so the host's clock waits for the
      device);
    - the rest (``split``'s ``other_seconds``): evaluations, checkpoints and log lines after the set-up,
      and what follows the last step.

    Only the steps of this run count (after a resume, not those done before it). With ``setup_steps`` steps
    or fewer there is no steady state."""

    def __init__(self, setup_steps: int = 2, now: Callable[[], float] = time.perf_counter):
        self.setup_steps, self.now = setup_steps, now
        self.start = now()
        self.steps = 0  # optimizer steps ended in this run
        self.setup_end = None  # when the set-up's last step ended
        self.steady = 0.0  # seconds inside the steady steps
        self.mark = self.start  # when the latest step, log, evaluation or checkpoint ended
        self.end = None  # when training ended

    def _mark(self, *args, **kwargs):
        self.mark = self.now()

    on_log = on_evaluate = on_save = _mark

    def on_step_end(self, args, state, control, **kwargs):
        t = self.now()
        self.steps += 1
        if self.steps > self.setup_steps:
            self.steady += t - self.mark
        elif self.steps == self.setup_steps:
            self.setup_end = t
        self.mark = t

    def on_train_end(self, args, state, control, **kwargs):
        self.end = self.now()

    def measured(self, tokens_per_step: int) -> dict:
        """This stage's split, with ``tokens_per_step`` tokens in each optimizer step (over every process):
        ``seconds`` (from the clock's making to the end of training), ``setup`` and ``steady`` (each
        ``seconds``, ``steps``, ``tokens``; steady also ``tokens_per_second``, None without steady steps)."""
        end = self.end if self.end is not None else self.now()
        setup_steps = min(self.steps, self.setup_steps)
        setup_end = self.setup_end if self.setup_end is not None else (self.mark if self.steps else self.start)
        steady_steps = self.steps - setup_steps
        return {"seconds": end - self.start,
                "setup": {"seconds": setup_end - self.start, "steps": setup_steps,
                          "tokens": setup_steps * tokens_per_step},
                "steady": {"seconds": self.steady, "steps": steady_steps, "tokens": steady_steps * tokens_per_step,
                           "tokens_per_second": _rate(steady_steps * tokens_per_step, self.steady)}}


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens and seconds > 0 else None


def split(records: list[dict], seconds: float | None = None) -> dict:
    """Several stages' ``StepClock.measured`` records added up: ``setup`` and ``steady`` (each ``seconds``,
    ``steps``, ``tokens``, ``tokens_per_second``) and ``other_seconds``, the rest of ``seconds`` (the wall
    time they were part of; default: the records' own): evaluations, checkpoints, log lines, and
    whatever ran between the stages. Set-up tokens/s counts the first steps' tokens over the whole
    set-up, so it says how long the set-up delays a run, not how fast its steps are."""
    out = {}
    for part in ("setup", "steady"):
        total = {key: sum(r[part][key] for r in records) for key in ("seconds", "steps", "tokens")}
        out[part] = {**total, "tokens_per_second": _rate(total["tokens"], total["seconds"])}
    wall = sum(r["seconds"] for r in records) if seconds is None else seconds
    out["other_seconds"] = max(0.0, wall - out["setup"]["seconds"] - out["steady"]["seconds"])
    return out


def split_line(split_record: dict) -> str:
    """``split``'s record in a summary's words: the set-up's seconds and steps, the steady tokens/s."""
    setup, steady = split_record["setup"], split_record["steady"]
    rate = "no steady steps" if steady["tokens_per_second"] is None else \
        f"steady {steady['tokens_per_second']:,.0f} tok/s over {steady['steps']} steps"
    return f"set-up {setup['seconds']:.1f}s ({setup['steps']} steps), {rate}"


class RecipeTrainer(Trainer):
    """A Trainer whose loss comes from the recipe; ``graphed`` (a ``linearize.graphed.GraphedLoss``)
    computes the training loss, and through it the backward, from CUDA graphs (a distillation
    objective's teacher runs eagerly first: its ``teacher_tensors`` go into the replay)."""

    def __init__(self, *args, loss_fn: LossFn, graphed=None, eval_extra: dict[str, LossFn] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_fn = loss_fn
        self.graphed = graphed
        self.model_accepts_loss_kwargs = False  # the recipe's loss is a per-batch mean
        # losses evaluated beside the objective on the validation batches, logged as eval_<name>
        # (the mean over this process's batches)
        self.eval_extra = dict(eval_extra or {})
        self._extra_sums: dict[str, list[float]] = {}
        self._hooks_off = False  # DDP's gradient hooks taken off (graphed steps under several processes)

    def training_step(self, model, inputs, num_items_in_batch=None):
        several = self.graphed is not None and self.accelerator.num_processes > 1
        if several and isinstance(model, torch.nn.parallel.DistributedDataParallel) and not self._hooks_off:
            # a graphed step never runs DDP's forward, which arms its gradient hooks, so they would
            # only cost time on every parameter; the gradients are averaged below, once per optimizer
            # step (the graphs were captured before DDP wrapped the model: _graphed_loss)
            model._remove_autograd_hooks()
            self._hooks_off = True
        loss = super().training_step(model, inputs, num_items_in_batch)
        if several and self.accelerator.sync_gradients:
            average_gradients(self.model)
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.graphed is not None and model.training and torch.is_grad_enabled():
            loss = self.graphed(inputs["input_ids"], inputs["labels"], *_teacher_tensors(self.loss_fn, model, inputs))
        else:
            loss = self.loss_fn(model, inputs)
        if model.training and not bool(torch.isfinite(loss.detach())):
            # stop before this step's update and before any save: the last checkpoint stays good
            raise LinearizeError(f"the loss became NaN/inf at step {self.state.global_step + 1}; the last checkpoint "
                                 f"in {self.args.output_dir} is kept (lower the learning rate?)")
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.loss_fn(model, inputs).detach()
            for name, fn in self.eval_extra.items():
                total = self._extra_sums.setdefault(name, [0.0, 0])
                total[0] += float(fn(model, inputs))
                total[1] += 1
        return loss, None, None

    def log(self, logs: dict, *args, **kwargs):
        if "eval_loss" in logs and self._extra_sums:
            logs = {**logs, **{f"eval_{name}": s / max(n, 1) for name, (s, n) in self._extra_sums.items()}}
            self._extra_sums = {}
        return super().log(logs, *args, **kwargs)


def average_gradients(model: torch.nn.Module, bucket_bytes: int = 1 << 28) -> None:
    """Average the gradients of ``model``'s trained parameters over the processes of the default group:
    flattened into buckets of at most ``bucket_bytes`` (one all-reduce each), divided by the world size,
    copied back. What DDP does during the backward, for steps whose backward DDP does not see
    (CUDA-graph replays); a trained parameter without a gradient counts as zero on that process."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    world = dist.get_world_size()
    grads = []
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}  # bytes in each group's last bucket
    for g in grads:
        key, size = (g.dtype, g.device), g.numel() * g.element_size()
        group = buckets.setdefault(key, [[]])
        if group[-1] and filled[key] + size > bucket_bytes:
            group.append([])
            filled[key] = 0
        group[-1].append(g)
        filled[key] = filled.get(key, 0) + size
    for key in sorted(buckets, key=str):  # the same order on every process
        for bucket in buckets[key]:
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat)
            flat.div_(world)
            for g, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(averaged)



def gathered_state(model, keep: bool = True, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """``model``'s whole state dict on the CPU; FSDP-sharded tensors are gathered one at a time (a collective:
    every rank calls it), so no GPU holds the whole model at once. A process with ``keep`` False takes part in
    the gathers and keeps nothing (``{}``): N copies of a 70B model would not fit one host's memory. ``only``:
    these names alone (every rank the same), the rest neither gathered nor kept."""
    from torch.distributed.tensor import DTensor

    state = {}
    for name, t in model.state_dict().items():
        if only is not None and name not in only:
            continue
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            state[name] = full.detach().cpu()
        del full
    return state


def unsharded(model, device=None, main_only: bool = False):
    """``model`` itself, or, where FSDP sharded it in place (a stage trained under accelerate's FSDP
    config), a plain copy on ``device`` (None: the process's own, the GPU it was sharded over) with the
    gathered weights and ``requires_grad`` flags, so the next stage wraps a fresh model and rank 0 can
    save and decode it alone. Every rank calls it. ``main_only``: where only the main process goes on with
    the model (it saves and samples it), the other processes take part in the gathers and get ``model`` back
    as it is, sharded, keeping no copy."""
    from ..distill.probes import fully_sharded

    if not fully_sharded(model):
        return model
    if main_only and not is_main_process():
        gathered_state(model, keep=False)
        return model
    state = gathered_state(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if device is None:
        device = process_device()
    plain = type(model)._from_config(model.config, dtype=next(model.parameters()).dtype)
    plain.load_state_dict(state, strict=True)
    plain.to(device)
    for n, p in plain.named_parameters():
        p.requires_grad_(n in trainable)
    return plain

def _gloo_on_one_host() -> None:
    """Gloo finds its network device by resolving the host name; on machines whose name does not
    resolve (containers, CI) a single-host run would fail, so it uses the loopback device instead."""
    import socket

    if os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        return
    try:
        socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def _early_stopping(cfg: TrainConfig, has_eval: bool) -> bool:
    """Whether the stage stops early: a patience, a validation set, and checkpoints to return to the best of."""
    return cfg.early_stopping_patience is not None and has_eval and cfg.save_total_limit > 0


def training_arguments(cfg: TrainConfig, has_eval: bool) -> TrainingArguments:
    multi_process_cpu = not torch.cuda.is_available() and world_size() > 1
    if multi_process_cpu:
        _gloo_on_one_host()
    bf16 = torch.cuda.is_available() if cfg.bf16 is None else cfg.bf16
    save_steps = cfg.save_steps or cfg.eval_steps
    early = _early_stopping(cfg, has_eval)
    return TrainingArguments(
        output_dir=cfg.output_dir,
        learning_rate=cfg.learning_rate,
        num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        lr_scheduler_type=cfg.scheduler,
        warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_betas[0],
        adam_beta2=cfg.adam_betas[1],
        max_grad_norm=cfg.max_grad_norm,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=cfg.eval_steps,
        save_strategy="steps" if cfg.save_total_limit else "no",
        save_steps=save_steps,
        save_total_limit=cfg.save_total_limit or None,
        load_best_model_at_end=early,
        metric_for_best_model="eval_loss" if early else None,
        greater_is_better=False if early else None,
        logging_steps=cfg.logging_steps,
        logging_nan_inf_filter=False,  # log a NaN as NaN, not as an average of earlier losses
        seed=cfg.seed,
        data_seed=cfg.seed,
        bf16=bf16,
        torch_compile=cfg.compile,
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_drop_last=cfg.cuda_graph,  # graphed steps keep one batch shape (a short last batch recaptures)
        # every objective reaches each parameter it trains (attention transfer through each layer's MSE),
        # so DDP skips the per-step search for unused ones (which the Trainer would otherwise turn on for
        # PEFT models: LoRA stage 2), and waits for every trained parameter's gradient
        ddp_find_unused_parameters=False,
        # CPU runs (tests, laptops) go multi-process through gloo when started with torchrun
        use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if multi_process_cpu else None,
        disable_tqdm=False,
        **cfg.extra,
    )


def train(model, train_dataset, eval_dataset, loss_fn: LossFn, cfg: TrainConfig, *, stage: str,
          callbacks: list[TrainerCallback] = (), resume: bool | str | None = None,
          metrics_path: str | Path | None = None, clock: StepClock | None = None) -> RecipeTrainer:
    """Run one training stage; returns the Trainer (its ``state.log_history`` has the curves, its
    ``speed`` the stage's ``StepClock.measured`` record).

    ``resume``: True continues from the newest checkpoint in ``output_dir``, a path from that one.
    Metrics are appended to ``metrics_path`` (default ``output_dir/metrics.jsonl``), tagged with ``stage``;
    the speed record is its last line (``speed``) and goes into ``output_dir/train_config.json`` too.
    ``clock``: the stage's ``StepClock``, made by the caller where the stage's set-up begins (default:
    one made now, with ``cfg.setup_steps``).
    """
    clock = clock or StepClock(cfg.setup_steps)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise LinearizeError(f"{stage}: nothing to train (no parameter requires grad)")
    if len(train_dataset) == 0:
        raise LinearizeError(f"{stage}: the training data is empty")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = Path(metrics_path or out / "metrics.jsonl")
    all_callbacks = [JsonlLogger(metrics, stage), *callbacks, clock]
    if cfg.profile_steps:
        all_callbacks.append(StepProfiler(cfg.profile_steps, cfg.setup_steps, out / "profile.json", stage))
    if _early_stopping(cfg, eval_dataset is not None):
        all_callbacks.append(EarlyStoppingCallback(early_stopping_patience=cfg.early_stopping_patience))
    elif cfg.early_stopping_patience is not None and eval_dataset is not None and is_main_process():
        print(f"linearize: {stage}: no early stopping: it returns to the best checkpoint, and --keep-checkpoints 0 "
              "writes none", file=sys.stderr)
    args = training_arguments(cfg, eval_dataset is not None)
    trainer = RecipeTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        callbacks=all_callbacks,
        loss_fn=loss_fn,
        eval_extra={"next_token": next_token_loss} if cfg.eval_next_token else None,
        graphed=_graphed_loss(model, loss_fn, cfg, args, train_dataset) if cfg.cuda_graph else None,
    )
    if resume is True:
        resume = _complete_checkpoint(out)
    with transient_bars(), checkpointed_layers(model, cfg.gradient_checkpointing, stage):
        trainer.train(resume_from_checkpoint=resume)  # a NaN/inf loss raises LinearizeError (compute_loss)
    per_step = cfg.batch_size * cfg.grad_accum * len(train_dataset[0]["input_ids"]) * trainer.args.world_size
    trainer.speed = clock.measured(per_step)
    if is_main_process():
        with (out / "train_config.json").open("w") as fh:
            json.dump({**asdict(cfg), "stage": stage, "world_size": world_size(), "speed": trainer.speed}, fh, indent=1)
        with metrics.open("a") as fh:
            fh.write(json.dumps({"stage": stage, "step": trainer.state.global_step, "speed": trainer.speed}) + "\n")
    return trainer



@contextmanager
def checkpointed_layers(model, on: bool, stage: str):
    """Inside, where ``on``, ``model``'s decoder layers (transformers' ``GradientCheckpointingLayer``) keep only
    their inputs in a training forward and run again in the backward (non-reentrant ``torch.utils.checkpoint``:
    frozen inputs need no gradient, and a loss may read tensors made inside a layer, as attention transfer's
    probes do); off again afterwards, so evaluation and decoding run as before."""
    if not on:
        yield
        return
    # transformers 5.24 renamed the methods (activation_...), 5.17 has the older names only
    names = next((pair for pair in (("activation_checkpointing_enable", "activation_checkpointing_disable"),
                                    ("gradient_checkpointing_enable", "gradient_checkpointing_disable"))
                  if callable(getattr(model, pair[0], None))), None)
    if names is None or not getattr(unwrap(model), "supports_gradient_checkpointing", False):
        raise LinearizeError(f"{stage}: --gradient-checkpointing: {type(unwrap(model)).__name__} has no checkpointed "
                             "layers (transformers' gradient_checkpointing_enable)")
    kwargs = {"use_reentrant": False}
    getattr(model, names[0])(**{names[0].replace("enable", "kwargs"): kwargs})
    try:
        yield
    finally:
        getattr(model, names[1])()


def _complete_checkpoint(out: Path) -> str | None:
    """The latest checkpoint in ``out`` that the Trainer finished writing (its trainer_state.json is
    written last, and a kill while writing it leaves it empty or cut short, so it must also parse), or
    None. A later one left half-written by a killed run is removed (on the main process), so the
    resumed run writes it afresh instead of loading a torn checkpoint."""
    import shutil
    import sys

    def finished(p: Path) -> bool:
        try:
            return isinstance(json.loads((p / "trainer_state.json").read_text()), dict)
        except (OSError, ValueError):
            return False

    def step(p: Path) -> int:
        tail = p.name.rsplit("-", 1)[-1]
        return int(tail) if tail.isdigit() else -1

    found = sorted((p for p in out.glob("checkpoint-*") if p.is_dir() and step(p) >= 0), key=step)
    complete = [p for p in found if finished(p)]
    last = complete[-1] if complete else None
    for p in found:
        if p not in complete and (last is None or step(p) > step(last)) and is_main_process():
            print(f"linearize: {p} was left half-written (the run was stopped while saving it); "
                  f"resuming from {last.name if last else 'the start of this stage'}", file=sys.stderr)
            shutil.rmtree(p, ignore_errors=True)
    return str(last) if last is not None else None


def _teacher_tensors(loss_fn: LossFn, model, batch: dict) -> tuple[torch.Tensor, ...]:
    """What a graphed ``loss_fn`` reads from the teacher for ``batch``, computed eagerly (none for the
    next-token loss, nor for a loss captured whole: it runs its own forward)."""
    if getattr(loss_fn, "captured_whole", False):
        return ()
    compute = getattr(loss_fn, "teacher_tensors", None)
    return compute(model, batch) if compute is not None else ()


def _graphed_loss(model, loss_fn: LossFn, cfg: TrainConfig, args: TrainingArguments, train_dataset=None):
    """The CUDA-graph replay of the training loss (``--cuda-graph``), where it applies: losses computed
    from the student's own forward and tensors from the teacher's, computed before the replay
    (``distill`` losses marked ``capturable``: the next-token loss, kl), and losses that run the
    student's forward themselves (``captured_whole``: attention_mse)."""
    from ..graphed import GraphedLoss, use_graphs

    capturable = loss_fn is next_token_loss or getattr(loss_fn, "uncapturable", None) == []
    use_graphs("on", cuda=torch.cuda.is_available(), uncapturable=None if capturable else _loss_name(loss_fn),
               fsdp=under_fsdp(), compile=cfg.compile)  # one line where a condition fails
    objective = None if loss_fn is next_token_loss else loss_fn
    graphed = GraphedLoss(model, torch.bfloat16 if args.bf16 else None, objective=objective)
    if world_size() > 1 and train_dataset is not None:
        # under several processes the graphs are captured before the Trainer wraps the model in DDP
        # (a capture inside the wrapped Trainer step fails: cudaErrorStreamCaptureImplicit); the
        # training batches have this shape (the last short one is dropped), so the steps replay them;
        # the teacher's tensors for this batch have the shapes the steps' will have
        ids = torch.zeros(cfg.batch_size, len(train_dataset[0]["input_ids"]), dtype=torch.long,
                          device=next(model.parameters()).device)
        model.train()
        batch = {"input_ids": ids, "labels": ids.clone()}
        graphed.prime(batch["input_ids"], batch["labels"], *_teacher_tensors(loss_fn, model, batch))
    return graphed


def _loss_name(loss_fn) -> str:
    name = repr(loss_fn) if hasattr(loss_fn, "terms") else getattr(loss_fn, "__name__", type(loss_fn).__name__)
    return f"the loss {name!r}"
