"""Training throughput: tokens/s of a full fine-tuning step (forward, backward, AdamW) of the
teacher and of the students the uptraining recipes train, at several batch x length shapes.

    python -m linearize.bench.train [--teacher default] [--models teacher supra t2r retnet striped_mamba]
                                    [--shapes 16x1024 8x2048 2x8192] [--steps 10] [--out train.json]
                                    [--compile] [--cuda-graph]

Every model trains all its weights, as in SUPRA uptraining and XATL with unfrozen transfer, except
the LoLCATs stages: ``lolcats-stage1`` trains the feature maps and window weights of a converted
student on the attention-transfer loss (every layer's output MSE to the teacher's softmax
attention, the teacher's output passed on: one teacher and one student attention per layer),
``lolcats-stage2`` LoRA (r=8 on q/k/v/o) on next-token loss, as ``linearize lolcats`` does; their
ratio is to the teacher's full fine-tune. ``lolcats-long-stage1`` / ``-stage2`` are the same stages
of the length-robust student (``LONG_SPEC``: features of the q/k before RoPE, data-dependent gates on
the linear state, issue #46), whose stage 1 also trains the gates. fp32 master weights with bf16
autocast on CUDA (the Trainer's ``bf16=True``), fp32 on CPU. Each shape
gets ``--warmup`` untimed steps (compilation, fla autotuning, allocator) and ``--steps`` timed
ones; tokens/s = batch x length x steps / seconds, with the peak memory on CUDA. A shape that runs
out of memory is recorded as such. The ratio column compares each model with the teacher at the
same shape.

``--compile`` runs every model's forward through ``torch.compile`` (rows named ``MODEL+compile``;
each shape compiles anew). On the GPU the eager students spend part of their step launching
kernels (docs/RESULTS.md: SUPRA's kernels take 144 ms of a 171 ms step at 2 x 8192); compiling fuses
the mixers' elementwise work around fla's kernels.

``--cuda-graph`` replays each step's forward and backward as CUDA graphs (``linearize.graphed``;
rows named ``MODEL+graph``): the host no longer issues the kernels one by one. The LoLCATs stages
replay through the recipe's own graphed loss: stage 1's ``attention_mse`` captured whole, stage 2's
next-token loss on the LoRA model. Every ratio divides by the teacher's fastest run at the shape
(eager, compiled or graphed).

``--loss kl`` or ``kl+lm`` times the students' distillation step instead (rows named ``MODEL/LOSS``):
a frozen bf16 copy of the teacher runs forward each step (eagerly, also under ``--cuda-graph``,
whose replay then takes its logits) and the student trains on KL to it (+ next-token loss), as
``linearize supra|xatl --loss ...`` does after its alignment stage. The teacher's row stays its
next-token fine-tune, the divisor of every ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import kinds
from ..errors import LinearizeError

# train a part of the weights on their own loss: LoLCATs' stages, of the paper's student and the length-robust one
STAGES = ("lolcats-stage1", "lolcats-stage2", "lolcats-long-stage1", "lolcats-long-stage2")
LONG_SPEC = {"kind": "lolcats", "feature_rope": False, "decay": "gated"}  # the length-robust student's options
# the teacher, every mixer kind (linearize/kinds.py), SUPRA's T2R baseline and the LoLCATs stages
MODELS = ("teacher", *kinds.names(), "t2r", *STAGES)


@dataclass
class TrainRow:
    model: str
    batch: int
    length: int
    tokens_per_s: float | None
    ms_per_step: float | None
    peak_bytes: int | None
    ratio_to_teacher: float | None = None
    note: str = ""


def build(teacher, name: str, backend: str = "auto"):
    """The model ``name`` trains, built from ``teacher`` (which stays untouched)."""
    import linearize
    from linearize.convert.xatl_transfer import build_xatl

    if name == "teacher":
        import copy

        return copy.deepcopy(teacher)
    if name == "t2r":
        return linearize.convert(teacher, {"kind": "supra", "norm": "sum", "decay": "none", "backend": backend})
    if name.startswith("lolcats-long"):
        return linearize.convert(teacher, dict(LONG_SPEC))
    if name in ("lolcats", *STAGES):
        return linearize.convert(teacher, {"kind": "lolcats"})
    if name in kinds.names("convert"):
        return linearize.convert(teacher, {"kind": name, "backend": backend})
    if name in kinds.names("build"):
        return build_xatl(teacher, name, backend=backend, seed=0)[0]
    raise LinearizeError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def stage_setup(model, name: str):
    """For a LoLCATs stage row: make ``model`` train what that stage trains and return
    ``(model, objective)``: stage 1's ``attention_mse`` objective (called as ``objective(model, batch)``),
    stage 2's LoRA model with None (its next-token loss); for the other rows ``(model, None)``
    (next-token loss, every weight). Stage 1 goes through the recipe's own pieces (freezing, the
    ``attention_mse`` loss), so it times what ``linearize lolcats`` runs."""
    if name in ("lolcats-stage1", "lolcats-long-stage1"):
        from ..convert import mixers
        from ..distill import build_objective
        from ..recipes import lolcats

        layers = sorted(mixers(model))
        lolcats._freeze_all_but(model, set(layers))
        return model, build_objective("attention_mse", context=dict(layers=tuple(layers),
                                                                    mse_factor=lolcats.LolcatsConfig.mse_factor))
    if name in ("lolcats-stage2", "lolcats-long-stage2"):
        from ..models import get_adapter
        from ..recipes.lolcats import LolcatsConfig
        from ..recipes.lora import add_lora

        cfg = LolcatsConfig()
        return add_lora(model, cfg.lora_r, cfg.lora_alpha, get_adapter(model.config).lora_targets), None
    return model, None


def loss_of(objective):
    """``loss_fn(model, ids)`` of ``objective`` on a packed batch (its labels the ids); None for None."""
    if objective is None:
        return None
    return lambda m, ids: objective(m, {"input_ids": ids, "labels": ids})


def graphed_step(model, objective=None):
    """The CUDA-graph replay of ``model``'s step on ``objective`` (None: the next-token loss), as the
    recipes' engine replays it, called as ``graphed(ids, labels)``: a capturable objective's teacher
    tensors are computed eagerly before each replay; one captured whole takes the batch alone."""
    from ..graphed import GraphedLoss

    graphed = GraphedLoss(model, torch.bfloat16, objective=objective)
    if objective is None or objective.captured_whole:
        return graphed
    return lambda a, b: graphed(a, b, *objective.teacher_tensors(model, {"input_ids": a, "labels": b}))


def _step(model, optimizer, ids, autocast: bool, graphed=None, marks: list | None = None, loss_fn=None):
    """One training step; ``graphed`` (a ``linearize.graphed.GraphedLoss``) replays forward and
    backward from CUDA graphs; ``marks`` gets the host's clock after the forward, the backward and
    the optimizer (``bench.profile``'s host time per phase); ``loss_fn(model, ids)`` replaces the
    next-token loss."""
    if graphed is not None:
        loss = graphed(ids, ids)
    else:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = (loss_fn(model, ids) if loss_fn is not None
                    else model(input_ids=ids, labels=ids, use_cache=False).loss)
    if marks is not None:
        marks.append(time.perf_counter())
    loss.backward()
    if marks is not None:
        marks.append(time.perf_counter())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if marks is not None:
        marks.append(time.perf_counter())


def prepare(model, batch: int, length: int, all_weights: bool = True):
    """Every weight trainable (or, ``all_weights=False``, those already marked so), an AdamW (fused
    on CUDA) over them and a fixed random batch: ``(optimizer, ids, cuda)``."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    model.train()
    if all_weights:
        for p in model.parameters():
            p.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=cuda)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    return optimizer, ids.to(device), cuda


def _release(cuda: bool) -> None:
    """Give back what a finished row held: captured graphs sit in reference cycles (a graphed
    module's forward refers to the module), so collect them before emptying the allocator's cache."""
    import gc

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def measure(model, name: str, batch: int, length: int, steps: int, warmup: int, cuda_graph: bool = False,
            all_weights: bool = True, objective=None) -> TrainRow:
    """``objective``: a ``linearize.distill`` objective the step trains on (distillation rows, LoLCATs
    stage 1); None: the next-token loss. ``all_weights=False`` trains what ``model`` marks trainable."""
    optimizer, ids, cuda = prepare(model, batch, length, all_weights)
    device = ids.device
    loss_fn = loss_of(objective)
    graphed = graphed_step(model, objective) if cuda_graph else None
    try:
        if cuda_graph and cuda:  # the capture (first step) allocates what every replay uses: count it
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warmup):
            _step(model, optimizer, ids, cuda, graphed, loss_fn=loss_fn)
        if cuda:
            torch.cuda.synchronize(device)
            if not cuda_graph:
                torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(steps):
            _step(model, optimizer, ids, cuda, graphed, loss_fn=loss_fn)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        return TrainRow(name, batch, length, batch * length * steps / seconds, 1000 * seconds / steps, peak)
    except torch.OutOfMemoryError:
        return TrainRow(name, batch, length, None, None, None, note="out of memory")
    except RuntimeError as e:  # a capture that failed: say why in the row, go on with the next
        if not cuda_graph:
            raise
        return TrainRow(name, batch, length, None, None, None, note=f"capture failed: {str(e).splitlines()[0][:200]}")
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer, graphed
        _release(cuda)


def parse_shape(text: str) -> tuple[int, int]:
    try:
        b, t = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise LinearizeError(f"a shape is BATCHxLENGTH (e.g. 16x1024), not {text!r}") from None
    if b < 1 or t < 2:
        raise LinearizeError(f"shape {text!r}: batch must be >= 1 and length >= 2")
    return b, t


# the cuda_graph setting of ``run`` and ``--cuda-graph`` -> which steps each model is timed with (graphed or not)
GRAPH_MODES = {False: (False,), True: (True,), "off": (False,), "on": (True,), "both": (False, True)}


def run(teacher, models, shapes, steps: int = 10, warmup: int = 3, backend: str = "auto",
        compile: str | None = None, report=None, cuda_graph: bool | str = False, loss: str = "lm") -> list[TrainRow]:
    """``compile``: a ``torch.compile`` backend ("inductor" on the GPU) to compile each model's forward.
    ``cuda_graph``: replay each step's forward and backward as CUDA graphs (``linearize.graphed``): True
    or "on"; "both": each model eagerly, then graphed, in this one run (the ratios then divide by the
    teacher's faster row); False or "off": eagerly.
    ``loss``: what the students (not the teacher, not the LoLCATs stages) train on: ``lm``, or a
    distillation objective such as ``kl`` / ``kl+lm`` against a frozen copy of the teacher.
    ``report``: called with the rows so far after each one (a run cut short by a timeout keeps them)."""
    from ..distill import FrozenTeacher, build_objective, parse_objective

    modes = GRAPH_MODES.get(cuda_graph)
    if modes is None:
        raise LinearizeError(f"cuda_graph must be off, on or both, got {cuda_graph!r}")
    cuda_graph = True in modes
    if cuda_graph and not torch.cuda.is_available():
        raise LinearizeError("--cuda-graph needs a CUDA device")
    distil = [n for _, n in parse_objective(loss)] != ["next_token"]
    objective = build_objective(loss, teacher=FrozenTeacher(teacher)) if distil else None
    if objective is not None and cuda_graph and not objective.capturable:
        raise LinearizeError(f"--cuda-graph replays the next-token loss and kl; the loss {loss!r} cannot be captured")
    rows = []
    for name in models:
        model, stage_objective = stage_setup(build(teacher, name, backend), name)
        student_objective = objective if name != "teacher" and name not in STAGES else None
        label = name if student_objective is None else f"{name}/{loss}"
        if compile:
            model.forward = torch.compile(model.forward, backend=compile)
            label = f"{name}+compile"
        for graphed in modes:
            for b, t in shapes:
                row = measure(model, f"{label}+graph" if graphed else label, b, t, steps, warmup, cuda_graph=graphed,
                              all_weights=name not in STAGES, objective=stage_objective or student_objective)
                rows.append(row)
                print(json.dumps(asdict(row)), flush=True)
                if report is not None:
                    report(with_ratios(rows))
        del model
        _release(torch.cuda.is_available())
    return with_ratios(rows)


def with_ratios(rows: list[TrainRow]) -> list[TrainRow]:
    """Each row's tokens/s over the teacher's at its shape: its fastest run there (eager, compiled or
    graphed), so that no way of running the teacher that is faster is left out of the comparison."""
    base = {}
    for r in rows:
        if r.model.split("+")[0] == "teacher" and r.tokens_per_s:
            key = (r.batch, r.length)
            base[key] = max(base.get(key, 0.0), r.tokens_per_s)
    for r in rows:
        if r.tokens_per_s and base.get((r.batch, r.length)):
            r.ratio_to_teacher = r.tokens_per_s / base[(r.batch, r.length)]
    return rows


def table(rows: list[TrainRow]) -> str:
    lines = ["| model | batch x length | tokens/s | ms/step | peak GB | vs teacher |", "|---|---|---|---|---|---|"]
    for r in rows:
        tok = "—" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"
        ms = "—" if r.ms_per_step is None else f"{r.ms_per_step:.1f}"
        peak = "—" if r.peak_bytes is None else f"{r.peak_bytes / 2**30:.1f}"
        ratio = "—" if r.ratio_to_teacher is None else f"{r.ratio_to_teacher:.2f}x"
        lines.append(f"| {r.model} | {r.batch}x{r.length} | {tok} | {ms} | {peak} | {ratio} |" + (f" {r.note}" if r.note else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    import linearize

    p = argparse.ArgumentParser(prog="python -m linearize.bench.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default=None, help="a teacher as in 'linearize convert', e.g. shape:llama-3-8b (its "
                   "architecture, random weights: tokens/s and memory need no real ones; default: embedded SmolLM2)")
    p.add_argument("--models", nargs="+", default=["teacher", "supra", "t2r", "retnet", "striped_mamba"],
                   choices=MODELS, help="what to train (default: %(default)s)")
    p.add_argument("--shapes", nargs="+", default=["16x1024", "8x2048", "2x8192"],
                   help="BATCHxLENGTH shapes (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per shape (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "fla"], help="linear-attention backend")
    p.add_argument("--compile", action="store_true", help="compile each model's forward with torch.compile")
    p.add_argument("--cuda-graph", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                   help="replay each step's forward and backward as CUDA graphs (no host work per kernel): on (the "
                        "flag alone), or both: each model eagerly and graphed in this one run, the ratios dividing by "
                        "the teacher's faster row (default: %(default)s)")
    p.add_argument("--loss", default="lm",
                   help="what the students train on: lm (next-token), or kl / kl+lm against a frozen copy of the "
                        "teacher run each step, as the recipes' distillation does (default: %(default)s)")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes]
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        teacher, _ = linearize.load_teacher(args.teacher, dtype="float32", device=device)

        def save(rows):
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "torch": torch.__version__, "rows": [asdict(r) for r in rows]}, fh, indent=1)

        rows = run(teacher, args.models, shapes, args.steps, args.warmup, args.backend,
                   compile="inductor" if args.compile else None, report=save if args.out else None,
                   cuda_graph=args.cuda_graph, loss=args.loss)
    except LinearizeError as e:
        p.exit(2, f"linearize: error: {e}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
