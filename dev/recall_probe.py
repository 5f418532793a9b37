"""Where does a gated LoLCATs student lose the pass key past 2k? (issue #46; a diagnosis.)

The suite's passkey prompts (the same trials as ``linearize eval --tasks passkey --limit N``), each
scored teacher-forced: the prompt, then " " and the key. ``exact``: greedy decoding would answer the
key (every answer token the argmax, no digit after); ``logp``: the answer's summed log-probability.
Each variant changes the model's sparse cache or its linear terms at run time, no training:

* ``none``: no cache (the window and the linear state);
* ``S=N[:priority[:anchor]]`` (variants separated by ";"): the training-free sparse cache (default novelty / window);
* ``S=N...,lin=X``: the same with the linear terms scaled by X (0: window and cache alone; the
  query features times X, so every phi_q . phi_k term scales by X);
* ``S=N...,sinks=K``: the sequence's first K tokens outrank every other candidate (pinned);
* ``exact``: softmax attention over the whole prompt in every layer (the student's weights with no
  linear part): whether the converted weights can retrieve at all.

For cache variants also the needle's **retention**: the fraction of (layer, key head) caches left
by the prompt that hold every digit of the key (the needle out of the window).

    PYTHONPATH=src python dev/recall_probe.py CHECKPOINT --lengths 2k,4k,8k --limit 4 \
        --variants "none;S=256;S=256:novelty:joint;S=256,lin=0;exact"
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import linearize
from linearize import ops
from linearize.eval.tasks import passkey
from linearize.eval.tasks.needle import DEFAULT_DEPTHS, prompt_budget
from linearize.mixers.lolcats import LolcatsAttention


def parse_variant(text: str) -> dict:
    """``none`` | ``exact`` | ``S=256[:priority[:anchor]][,lin=X]`` -> settings."""
    out = dict(name=text, cache=0, priority="novelty", anchor="window", lin=1.0, exact=False, sinks=0)
    for part in text.split(","):
        if part == "none":
            continue
        if part == "exact":
            out.update(exact=True, cache=1)
        elif part.startswith("S="):
            bits = part[2:].split(":")
            out["cache"] = int(bits[0])
            out["priority"] = bits[1] if len(bits) > 1 else out["priority"]
            out["anchor"] = bits[2] if len(bits) > 2 else out["anchor"]
        elif part.startswith("sinks="):
            out["sinks"] = int(part[6:])
        elif part.startswith("lin="):
            out["lin"] = float(part[4:])
        else:
            raise SystemExit(f"unknown variant part {part!r}")
    return out


def softmax_op(q, k, qf, kf, v, gamma, *, scale, softcap=None, output_final_state=False, **_):
    """Causal softmax attention over every token, in place of the sparse op (``exact``)."""
    assert softcap is None, "exact: no softcap here"
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale), None


@contextmanager
def probed(lin: float, caches: list, exact: bool = False, sinks: int = 0):
    """The linear terms scaled by ``lin`` (the query features times it) and each sparse op's final
    cache positions appended to ``caches`` (``[Hk, S]`` positions, validity); ``exact``: softmax
    attention in place of the sparse op."""
    orig_inputs, orig_op = LolcatsAttention._inputs, ops.sparse_hybrid_attention_chunked

    def inputs(self, q, k, position_embeddings):
        q, k, qf, kf = orig_inputs(self, q, k, position_embeddings)
        return q, k, qf * lin, kf

    def op(*args, **kw):
        if exact:
            return softmax_op(*args, **kw)
        want = kw.pop("output_final_state", False)
        y, state = orig_op(*args, **kw, output_final_state=True)
        caches.append((state.cache_pos[0].cpu(), state.cache_valid[0].cpu()))
        return y, (state if want else None)

    from linearize.ops.hybrid import sparse_select as sha
    orig_pri = sha.priorities

    def pri(kind, kf, v, valid, linear, pos):  # the first ``sinks`` tokens outrank every other
        p = orig_pri(kind, kf, v, valid, linear, pos)
        return torch.where(pos < sinks, torch.finfo(p.dtype).max, p) if sinks else p

    LolcatsAttention._inputs, ops.sparse_hybrid_attention_chunked, sha.priorities = inputs, op, pri
    try:
        yield
    finally:
        LolcatsAttention._inputs, ops.sparse_hybrid_attention_chunked, sha.priorities = orig_inputs, orig_op, orig_pri


def needle_positions(tok, trial) -> list[int]:
    """Token positions of the key's digits in the trial's prompt."""
    enc = tok(trial.prompt, return_offsets_mapping=True)
    start = trial.prompt.index("The pass key is " + trial.answer) + len("The pass key is ")
    end = start + len(trial.answer)
    return [i for i, (a, b) in enumerate(enc.offset_mapping) if a < end and b > start]


def score(model, tok, trial, device):
    """``(exact, logp)`` of the trial's answer, teacher-forced."""
    answer = tok(" " + trial.answer, add_special_tokens=False).input_ids
    p = len(trial.ids)
    ids = torch.tensor([trial.ids + answer], device=device)
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, p - 1 :].float()
    guess = logits.argmax(-1).tolist()
    after = tok.convert_ids_to_tokens(guess[-1])
    exact = guess[:-1] == answer and not any(ch.isdigit() for ch in after)
    logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(answer, device=device)[:, None]).sum().item()
    return exact, logp


def retention(caches, needle) -> float | None:
    """Fraction of (layer, key head) caches holding every needle digit; None without caches."""
    held = n = 0
    for pos, valid in caches:  # [Hk, S] each
        for h in range(pos.shape[0]):
            kept = set(pos[h][valid[h]].tolist())
            held += all(p in kept for p in needle)
            n += 1
    return held / n if n else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--lengths", default="2k,4k,8k")
    ap.add_argument("--limit", type=int, default=4, help="trials per (length, depth) cell")
    ap.add_argument("--seed", type=int, default=1234, help="the suite's seed (eval's default)")
    ap.add_argument("--variants", default="none;S=256;S=256,lin=0;exact", help="separated by ;")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lengths = [int(x[:-1]) * 1024 if x.endswith("k") else int(x) for x in a.lengths.split(",")]
    variants = [parse_variant(v) for v in a.variants.split(";")]
    model, tok = linearize.load(a.checkpoint, device=a.device)
    model.eval()
    device = next(model.parameters()).device
    rows = prompt_budget(lengths, None, passkey.MAX_NEW_TOKENS, past_context=True)
    trials = [passkey.make_trial(tok, n, t, d, i, a.seed) for n, t in rows for d in DEFAULT_DEPTHS
              for i in range(a.limit)]
    results = []
    for v in variants:
        by_len = {}
        for trial in trials:
            linearize.respec(model, sparse_cache=v["cache"], sparse_priority=v["priority"], sparse_anchor=v["anchor"],
                             backend="auto" if v["lin"] == 1.0 else "torch")
            caches = []
            with probed(v["lin"], caches, v["exact"], v["sinks"]):
                exact, logp = score(model, tok, trial, device)
            needle = needle_positions(tok, trial)
            kept = None if v["exact"] or min(needle) >= len(trial.ids) - 64 else retention(caches, needle)
            row = dict(variant=v["name"], length=trial.length, depth=trial.depth, trial=trial.index,
                       exact=exact, logp=round(logp, 3), retention=kept)
            results.append(row)
            by_len.setdefault(trial.length, []).append(row)
        line = []
        for n, rs in by_len.items():
            kept = [r["retention"] for r in rs if r["retention"] is not None]
            ret = f" kept {sum(kept) / len(kept):.2f}" if kept else ""
            line.append(f"{n}: {100 * sum(r['exact'] for r in rs) / len(rs):.0f}% "
                        f"logp {sum(r['logp'] for r in rs) / len(rs):.1f}{ret}")
        print(f"{v['name']:<28} " + " | ".join(line), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(args=vars(a), results=results), fh, indent=1)


if __name__ == "__main__":
    main()
