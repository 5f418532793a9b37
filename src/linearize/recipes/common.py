"""What every recipe does around its training: data in, checkpoint and results out."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import save
from ..checkpoint import record_training
from ..data import BlockDataset, load_blocks
from .launch import is_main_process


def datasets(cfg, tokenizer):
    """Train and validation blocks from ``cfg.data`` (None: Gutenberg): (train_ds, eval_ds, eval_blocks)."""
    train_blocks = load_blocks(cfg.data, tokenizer, block_len=cfg.block_len, split="train",
                               max_blocks=cfg.train_blocks, seed=cfg.seed)
    eval_blocks = load_blocks(cfg.data, tokenizer, block_len=cfg.block_len, split="validation", max_blocks=cfg.eval_blocks)
    return BlockDataset(train_blocks), BlockDataset(eval_blocks), eval_blocks


def begin_run(cfg):
    """What every recipe run begins with: its output folder, the seed, the teacher, the data and the
    results record with the teacher's held-out perplexity.

    Returns ``(out, teacher, tokenizer, train_ds, eval_ds, eval_blocks, results)``."""
    from dataclasses import asdict

    from .. import load_teacher
    from ..eval import perplexity

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    teacher, tok = load_teacher(cfg.teacher, dtype=cfg.dtype)
    train_ds, eval_ds, eval_blocks = datasets(cfg, tok)
    results: dict = {"config": asdict(cfg), "train_tokens_per_epoch": train_ds.blocks.numel(),
                     "eval_tokens": eval_blocks.numel(), "perplexity": {"teacher": perplexity(teacher, eval_blocks)}}
    if is_main_process():  # a run stopped before results.json still says what its curves mean
        (out / "run_config.json").write_text(json.dumps(results["config"], indent=1, default=str))
    return out, teacher, tok, train_ds, eval_ds, eval_blocks, results


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
    save(student, tokenizer, out / "final")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(next(student.parameters()).device)
    with torch.no_grad():
        # long enough to run past a LoLCATs window (64), where the linear attention takes over;
        # through the fast decoder (the same greedy tokens as generate()) where it applies
        from ..errors import LinearizeError
        from ..fast import fast_generate

        try:
            sample = fast_generate(student, ids, max_new_tokens=80, pad_token_id=tokenizer.pad_token_id)
        except LinearizeError:
            sample = student.generate(ids, max_new_tokens=80, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    results["sample"] = tokenizer.decode(sample[0, ids.shape[1]:], skip_special_tokens=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return results
