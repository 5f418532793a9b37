"""The main job on the embedded default: ``python -m linearize.demo`` (``make demo``).

1. SmolLM2-135M-Instruct, converted to the LoLCATs hybrid with a window that covers the block,
   is the teacher (exactness check on real text).
2. The LoLCATs recipe as ``linearize lolcats`` runs it with no flags: stage 1 (attention transfer) and
   stage 2 (LoRA), with held-out perplexity of the teacher, the converted model and after each stage.
   The budget is a few minutes on the Gutenberg books on a CPU, ~10M tokens per stage of books, code
   and WordNet on a GPU (``--budget``), where the student also keeps its copying layers as window softmax
   (the default recipe file, ``lolcats_tiers``).
3. The final checkpoint loads without the teacher and decodes recurrently with a cache whose
   size does not grow with the generated length.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import linearize
from linearize.cache import LinearizeCache, cache_keyword, cache_nbytes
from linearize.data import load_blocks
from linearize.decode.route import plain_loop
from linearize.recipes import lolcats


def _held_bytes(model, prompt, n, pad_id):
    """Bytes of the decoding cache after ``n`` new tokens (transformers' own generate() loop fills the cache
    it is given)."""
    cache = LinearizeCache(model)
    model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id,
                   **{cache_keyword(model): cache}, **plain_loop(model))
    return cache_nbytes(cache)


def exactness(block_len: int, spec: dict) -> float:
    """Largest logit difference between the teacher and the recipe's student (``spec``) whose window covers
    the block: no token is older than the window, so it is exactly softmax attention."""
    teacher, tok = linearize.load_teacher()
    block = load_blocks(None, tok, block_len=block_len, split="validation", max_blocks=1).to(teacher.device)
    with torch.no_grad():
        reference = teacher(block).logits
        student = linearize.convert(teacher, {**spec, "window": block_len}, inplace=True)
        return (student(block).logits - reference).abs().max().item()


def recipe_config(out: Path, budget: str | None) -> lolcats.LolcatsConfig:
    """What ``linearize lolcats --out OUT [--budget BUDGET]`` runs, resolved as the command resolves it (on the
    gpu budget the default recipe file, ``settings.DEFAULT_CONFIG``)."""
    from .cli import _recipe_config, build_parser

    args = build_parser().parse_args(["lolcats", "--out", str(out), *(["--budget", budget] if budget else [])])
    return _recipe_config(args, lolcats.LolcatsConfig, lolcats.apply_budget, "runs/lolcats", lolcats.DEFAULT_SPEC)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linearize.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="run folder (default: %(default)s)")
    p.add_argument("--budget", choices=sorted(lolcats.BUDGETS), default=None,
                   help="LoLCATs token budget (default: gpu on CUDA, cpu otherwise)")
    a = p.parse_args(argv)
    start = time.time()
    cfg = recipe_config(a.out, a.budget)

    diff = exactness(cfg.block_len, cfg.spec)
    print(f"[1] LoLCATs hybrid with window {cfg.block_len} >= the block vs the softmax teacher: "
          f"max |logit difference| = {diff:.2e}")

    results = lolcats.run(cfg)
    print("[2] " + lolcats.summary(results))

    model, tok = linearize.load(a.out / "final")
    prompt = tok("It is a truth universally acknowledged, that", return_tensors="pt").input_ids.to(model.device)
    small, large = (_held_bytes(model, prompt, n, tok.pad_token_id) for n in (64, 128))
    print(f"[3] {a.out / 'final'} loads without the teacher; decoding cache after 64 / 128 new tokens: "
          f"{small:,} / {large:,} bytes")
    print(f"done in {time.time() - start:.0f}s; details in {a.out}/results.json and {a.out}/metrics.jsonl")


if __name__ == "__main__":
    main()
