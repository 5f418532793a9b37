"""ms a decoding step of each way to call generation on a converted checkpoint (issue #54), side by side.

    python dev/generate_routes.py [--teacher shape:smollm2-135m] [--config lolcats_tiers] [--keep-softmax 1,2,...]
                                  [--long 1,2,18,20] [--batches 1 64 256]

The student is converted from TEACHER (a named shape's random weights: speed does not depend on them) with the
packaged recipe CONFIG's spec, in bf16 on CUDA; where the recipe chooses its kept layers in training
(``keep_softmax: auto:K``), KEEP_SOFTMAX names them and LONG those of them the recipe's ``auto_softmax_long`` gives its
longer window (defaults: what the default recipe chose on SmolLM2-135M). Routes: ``fast_generate``; plain ``model.generate(ids,
max_new_tokens=N)`` (the default route); ``pipeline("text-generation")`` (batch 1); transformers' own loop
(``fast_decoding=False``, batch 1). A step's time is (T(N) - T(n)) / (N - n) from 1k-token prompts, N = 512 and
n = 32 new tokens (no end-of-sequence id), each call warmed up at its size first, so the prefill cancels. One JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def per_step(call, long: int = 512, short: int = 32) -> float:
    """ms a step of ``call(n)`` (n new tokens), the prefill cancelled."""
    call(short), call(long)  # warm-up at both sizes: graphs captured, allocator settled
    return 1000 * (timed(lambda: call(long)) - timed(lambda: call(short))) / (long - short)


def main() -> None:
    import yaml

    import linearize
    from linearize.fast import fast_generate
    from linearize.recipes.configs import packaged

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default="shape:smollm2-135m")
    p.add_argument("--config", default="lolcats_tiers")
    p.add_argument("--keep-softmax", default="1,2,7,8,10,11,12,14,15,17,18,19,20,23",
                   help="layers kept as (window) softmax where the recipe picks them in training")
    p.add_argument("--long", default="1,2,18,20", help="of those, the layers over auto_softmax_long's window")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-len", type=int, default=1024)
    args = p.parse_args()
    from linearize.spec import Spec

    recipe = yaml.safe_load(packaged(args.config).read_text())
    spec = {k: v for k, v in recipe.items() if k in Spec.__dataclass_fields__ and k != "keep_softmax"}
    keep = recipe.get("keep_softmax")
    if isinstance(keep, str) and keep.startswith("auto:"):
        keep = [int(i) for i in args.keep_softmax.split(",")]
        if recipe.get("auto_softmax_long"):  # N@W2: the named layers over W2
            width = str(recipe["auto_softmax_long"]).partition("@")[2]
            spec["softmax_window"] = ",".join([str(spec["softmax_window"])] + [f"{i}:{width}" for i in args.long.split(",")])
    teacher, tok = linearize.load_teacher(args.teacher, dtype=torch.bfloat16, device="cuda")
    model = linearize.convert(teacher, spec, keep_softmax=keep or None).eval()
    model.generation_config.eos_token_id = None  # random weights: every call runs its n new tokens
    vocab = model.config.vocab_size
    for batch in args.batches:
        ids = torch.randint(3, min(vocab, 255), (batch, args.prompt_len), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(0))
        mask = torch.ones_like(ids)
        rows = {
            "fast_generate": lambda n: fast_generate(model, ids, mask, max_new_tokens=n),
            "generate (default)": lambda n: model.generate(ids, attention_mask=mask, max_new_tokens=n),
        }
        if batch == 1:
            from transformers import pipeline

            pipe = pipeline("text-generation", model=model, tokenizer=tok)
            text = tok.decode(ids[0])
            rows["pipeline"] = lambda n: pipe(text, max_new_tokens=n, return_full_text=False)
            rows["generate, fast_decoding=False"] = lambda n: model.generate(
                ids, attention_mask=mask, max_new_tokens=n, fast_decoding=False)
        for route, call in rows.items():
            with torch.no_grad():  # transformers' own loop is the slow one: fewer steps
                ms = per_step(call, long=160) if "False" in route else per_step(call)
            print(json.dumps({"route": route, "batch": batch, "prompt_len": args.prompt_len, "ms_per_step": ms,
                              "teacher": args.teacher, "config": args.config}), flush=True)


if __name__ == "__main__":
    main()
