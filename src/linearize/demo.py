"""The foundation demo on the embedded default: ``python -m linearize.demo`` (``make demo``).

Loads SmolLM2-135M-Instruct, measures held-out perplexity on the Gutenberg validation books, shows
that the LoLCATs hybrid with a window covering the block *is* the teacher, converts it to the
default LoLCATs student (window 64, untrained Hedgehog maps: the LoLCATs recipe trains them),
saves and reloads the checkpoint, and decodes recurrently with a cache that does not grow.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import linearize
from linearize.cache import LinearizeCache, cache_nbytes
from linearize.data import load_blocks
from linearize.eval import perplexity


def _held_bytes(model, prompt, n, pad_id):
    cache = LinearizeCache(model) if getattr(model.config, "linearize", None) else None
    out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id,
                         past_key_values=cache, return_dict_in_generate=True)
    return cache_nbytes(out.past_key_values)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linearize.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=None, help="validation blocks (default: 4 on CPU, 64 on GPU)")
    p.add_argument("--block-len", type=int, default=None, help="tokens per block (default: 512 on CPU, 1024 on GPU)")
    a = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    n_blocks = a.blocks or (64 if gpu else 4)
    block_len = a.block_len or (1024 if gpu else 512)

    t = time.time()
    teacher, tok = linearize.load_teacher()
    print(f"teacher: SmolLM2-135M-Instruct, {sum(p.numel() for p in teacher.parameters()):,} parameters, "
          f"loaded in {time.time() - t:.1f}s on {next(teacher.parameters()).device}")
    blocks = load_blocks(None, tok, block_len=block_len, split="validation", max_blocks=n_blocks)
    print(f"held-out text: {len(blocks)} blocks x {block_len} tokens of austen-persuasion + carroll-alice")

    rows = [("teacher (softmax)", perplexity(teacher, blocks))]
    exact = linearize.convert(teacher, {"kind": "lolcats", "window": block_len})
    with torch.no_grad():
        diff = (exact(blocks[:1].to(teacher.device)).logits - teacher(blocks[:1].to(teacher.device)).logits).abs().max().item()
    rows.append((f"lolcats, window {block_len} >= block (exactly softmax)", perplexity(exact, blocks)))
    del exact
    student = linearize.convert(teacher, "lolcats")
    rows.append(("lolcats, window 64, untrained feature maps", perplexity(student, blocks)))
    print("\nheld-out perplexity")
    for name, ppl in rows:
        print(f"  {name:<52} {ppl:10.2f}")
    print(f"  max |logit difference| of the full-window hybrid vs the teacher: {diff:.2e}")

    with tempfile.TemporaryDirectory() as tmp:
        linearize.save(student, tok, tmp)
        loaded, _ = linearize.load(tmp)
        with torch.no_grad():
            same = torch.equal(loaded(blocks[:1, :128].to(loaded.device)).logits, student(blocks[:1, :128].to(student.device)).logits)
        print(f"\ncheckpoint saved and reloaded without the teacher: identical logits = {same}")

    prompt = tok("It is a truth universally acknowledged, that", return_tensors="pt").input_ids.to(teacher.device)
    out = loaded.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
    print("\nrecurrent decoding (untrained student):", repr(tok.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)))
    print("\ndecoding memory held by the cache (bytes)")
    for name, model in (("teacher (KV cache)", teacher), ("lolcats student (recurrent state)", loaded)):
        small, large = (_held_bytes(model, prompt, n, tok.pad_token_id) for n in (64, 256))
        print(f"  {name:<36} after 64 tokens {small:>12,}   after 256 tokens {large:>12,}")


if __name__ == "__main__":
    main()
