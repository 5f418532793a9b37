"""What every recipe does around its training: data in, checkpoint and results out."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .. import save
from ..checkpoint import record_training
from ..data import BlockDataset, load_blocks, with_repeats
from .launch import bind_process_gpu, is_main_process, under_fsdp

# what results.json says of a measurement left out under accelerate's FSDP config (results["skipped"])
SKIPPED_UNDER_FSDP = ("under FSDP the teacher loads on the CPU and no whole model goes onto one GPU before the "
                      "Trainer shards it, so nothing is measured before training (the trained student is, sharded)")


@contextmanager
def phase(results: dict, name: str):
    """Adds the wall seconds of the block to ``results["phases"][name]`` (phases in the order first met),
    the GPU's queued work included: where a run's time goes besides training (loading, tokenizing,
    the evaluations between stages, saving)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        phases = results.setdefault("phases", {})
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


def phases_line(results: dict) -> str | None:
    """One summary line: each phase's seconds, the largest first, and their total."""
    phases = results.get("phases")
    if not phases:
        return None
    parts = ", ".join(f"{name} {seconds:.0f}s" for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1]))
    return f"  wall time {sum(phases.values()):.0f}s: {parts}"


def datasets(cfg, tokenizer):
    """Train and validation blocks from ``cfg.data`` (None: Gutenberg), a share ``cfg.repeats`` of the training
    blocks given a verbatim repeat (``data.repeats``): (train_ds, eval_ds, eval_blocks)."""
    train_blocks = load_blocks(cfg.data, tokenizer, block_len=cfg.block_len, split="train",
                               max_blocks=cfg.train_blocks, seed=cfg.seed)
    train_blocks = with_repeats(train_blocks, cfg.repeats, seed=cfg.seed)
    eval_blocks = load_blocks(cfg.data, tokenizer, block_len=cfg.block_len, split="validation", max_blocks=cfg.eval_blocks)
    return BlockDataset(train_blocks), BlockDataset(eval_blocks), eval_blocks


def begin_run(cfg, skip_under_fsdp: tuple[str, ...] = ()):
    """What every recipe run begins with: its output folder, the seed, the teacher, the data and the
    results record with the teacher's held-out perplexity.

    Under accelerate's FSDP config (``launch.under_fsdp``) the teacher loads on the CPU (in the dtype it
    would have on the process's device: bf16 on CUDA unless ``cfg.dtype`` says otherwise), where the
    recipe builds the student from it; the Trainer's ``fully_shard`` moves each unit to the GPU, so no
    GPU holds a whole model. Nothing is evaluated before that: the teacher's perplexity and what the
    recipe names in ``skip_under_fsdp`` (e.g. ``"perplexity: student, before training"``) are listed in
    ``results["skipped"]`` with the reason, and the main process says so in one line.
    ``results["teacher_loaded_on"]`` records the device the teacher was loaded on.

    Returns ``(out, teacher, tokenizer, train_ds, eval_ds, eval_blocks, results)``."""
    from dataclasses import asdict

    from .. import load_teacher
    from ..eval import perplexity

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    bind_process_gpu()  # under torchrun, rank r's teacher goes to GPU r: its kernels must launch there
    fsdp = under_fsdp()
    timing: dict = {}
    with phase(timing, "teacher"):
        teacher, tok = fsdp_teacher(cfg) if fsdp else load_teacher(cfg.teacher, dtype=cfg.dtype)
    with phase(timing, "data"):
        train_ds, eval_ds, eval_blocks = datasets(cfg, tok)
    results: dict = {"config": asdict(cfg), "train_tokens_per_epoch": train_ds.blocks.numel(),
                     "eval_tokens": eval_blocks.numel(), "teacher_loaded_on": str(next(teacher.parameters()).device),
                     "perplexity": {}, **timing}
    if fsdp:
        skipped = ("perplexity: teacher", *skip_under_fsdp)
        results["skipped"] = dict.fromkeys(skipped, SKIPPED_UNDER_FSDP)
        if is_main_process():
            print(f"linearize: under FSDP the teacher loads on the CPU and nothing is measured before the training "
                  f"shards the models; skipped: {', '.join(skipped)} (results.json: skipped)", file=sys.stderr)
    else:
        with phase(results, "perplexity: teacher"):
            results["perplexity"]["teacher"] = perplexity(teacher, eval_blocks)
    if is_main_process():  # a run stopped before results.json still says what its curves mean
        (out / "run_config.json").write_text(json.dumps(results["config"], indent=1, default=str))
    return out, teacher, tok, train_ds, eval_ds, eval_blocks, results


def fsdp_teacher(cfg):
    """``cfg.teacher`` as a run under FSDP loads it: on the CPU, in the dtype the process's own device would give
    it (a bf16 safetensors checkpoint stays file pages there, which the processes share; ``docs/scale.md``).
    Returns ``(teacher, tokenizer)``."""
    from .. import load_teacher
    from ..teacher import resolve_device, resolve_dtype

    return load_teacher(cfg.teacher, dtype=resolve_dtype(cfg.dtype, resolve_device(None)), device="cpu")


CPU_SAMPLE_BYTES = 40 * 2**30  # past this a student's sample is not decoded on the CPU (an 8B fp32 one took 3 min)


def sampling_device(student):
    """``student`` where its sample decodes, or None to skip the sample. A student FSDP trained is gathered on
    the CPU to be saved (an 8B one took about three minutes to decode its 80 tokens there): it goes to the GPU
    where the GPU has room for it, in its dtype, else in bfloat16; where neither fits it stays on the CPU, with
    one line, or, past ``CPU_SAMPLE_BYTES``, is not sampled (one line too)."""
    if next(student.parameters()).device.type != "cpu":
        return student
    dtype0 = next(student.parameters()).dtype
    need = sum(t.numel() * t.element_size() for t in [*student.parameters(), *student.buffers()])
    where = "no GPU"
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        where = f"the GPU's free {free / 2**30:.1f} GiB"
        half = need // 2 if dtype0 == torch.float32 else need
        for size, dtype in ((need, None), (half, torch.bfloat16)):
            if size * 1.25 < free:  # the weights and room for the decoder's state and activations
                try:
                    return student.to("cuda") if dtype is None else student.to("cuda", dtype)
                except torch.cuda.OutOfMemoryError:
                    student.to("cpu", dtype0)
                    torch.cuda.empty_cache()
    if need > CPU_SAMPLE_BYTES:
        print(f"linearize: no sample: the student ({need / 2**30:.1f} GiB) does not fit {where}, and decoding it on "
              "the CPU would take long (OUT/final decodes with `linearize generate`)", file=sys.stderr)
        return None
    if torch.cuda.is_available():
        print(f"linearize: the sample decodes on the CPU: the student ({need / 2**30:.1f} GiB) does not fit {where}",
              file=sys.stderr)
    return student


def finish(student, tokenizer, out: Path, results: dict, prompt: str) -> dict:
    """Record the run in the student's config (``record_training``: recipe, tokens, date), save
    ``out/final``, write ``out/results.json``, then add a greedy sample decoded recurrently to it. The
    results are written before the sample is decoded, so a decoding that fails loses none of them.

    Only the main process writes; the other ranks of a multi-process run return the results as they are.
    """
    for p in student.parameters():
        p.requires_grad_(True)
    if not is_main_process():
        return results
    cfg, train = results.get("config", {}), results.get("train", {})
    record_training(student, cfg.get("method") or "lolcats", train.get("tokens", 0), steps=train.get("steps"),
                    seconds=train.get("seconds"), data=cfg.get("data") or "gutenberg",
                    **({"stages": list(cfg["stages"])} if "stages" in cfg else {}))
    with phase(results, "save"):
        save(student, tokenizer, out / "final")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    student = sampling_device(student)
    if student is None:
        results["sample"] = None
        return results
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(next(student.parameters()).device)
    with torch.no_grad(), phase(results, "sample"):
        # long enough to run past a LoLCATs window (64), where the linear attention takes over;
        # through the fast decoder (the same greedy tokens as generate()) where it applies
        from ..errors import LinearizeError
        from ..fast import fast_generate

        try:
            sample = fast_generate(student, ids, max_new_tokens=80, pad_token_id=tokenizer.pad_token_id)
        except LinearizeError:  # a model the fast decoder cannot run: transformers' own loop
            from ..decode.route import plain_loop

            sample = student.generate(ids, max_new_tokens=80, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                      **plain_loop(student))
    results["sample"] = tokenizer.decode(sample[0, ids.shape[1]:], skip_special_tokens=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return results
