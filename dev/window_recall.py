"""Which of the teacher's layers must see the whole context for recall? A ceiling for keep_softmax auto:K.

The teacher runs with sliding-window softmax (the student's window) in every layer but a set K,
which keeps full causal softmax; passkey prompts are scored teacher-forced (the answer's digits,
all argmax-right = correct; and their mean NLL). K grows greedily by the largest NLL drop.
If the teacher itself cannot recall with K global layers, no student with K softmax layers will.
``--oracle``: every windowed layer also sees the needle sentence's tokens ("The pass key is N.
Remember it."), as an exact cache that kept exactly the needle would: a ceiling for any rule that
picks which tokens a sparse cache keeps (``sparse_cache``) beside the window.

    PYTHONPATH=src python dev/window_recall.py --lengths 1024 2048 --trials 2 --rounds 2 [--teacher T]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn

from linearize.convert import convert
from linearize.distill.probes import swapped
from linearize.eval.tasks import passkey
from linearize.eval.tasks.needle import DEFAULT_DEPTHS
from linearize.convert.layers import mixers
from linearize.ops.softmax_attention import softmax_attention
from linearize.teacher import load_teacher


class Windowed(nn.Module):
    """The teacher's softmax attention from ``m``'s projections over the last ``window`` keys (and
    the first ``sinks``, as StreamingLLM keeps); ``window`` None: every earlier key."""

    cached: torch.Tensor | None = None  # positions every windowed query also sees (``--oracle``), set per prompt

    def __init__(self, m, window, sinks=0):
        super().__init__()
        self.mixer, self.config, self.window, self.sinks = m, m.config, window, sinks

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        m = self.mixer
        q, k, v = m.adapter.qkv(m, hidden_states)
        qr, kr = m.adapter.rope(m, q, k, position_embeddings)
        g = m.geometry
        if self.window is None or not (self.sinks or Windowed.cached is not None):
            o = softmax_attention(qr, kr, v, scale=g.scaling, softcap=g.softcap, window=self.window)
        else:
            pos = torch.arange(q.shape[2], device=q.device)
            dist = pos[:, None] - pos[None, :]
            seen = pos < self.sinks
            if Windowed.cached is not None:
                seen = seen | torch.isin(pos, Windowed.cached.to(pos.device))
            allowed = (dist >= 0) & ((dist < self.window) | seen[None, :])
            o = torch.nn.functional.scaled_dot_product_attention(qr, kr, v, attn_mask=allowed, scale=g.scaling,
                                                                 enable_gqa=True)
        return m.adapter.out(m, o), None


@torch.no_grad()
def score(model, trials, global_layers, window, device, sinks=0):
    keep = set(global_layers)
    nll, right = 0.0, 0
    with swapped(model, lambda m: Windowed(m, None if m.layer_idx in keep else window, sinks)):
        for ids, answer, needle in trials:
            Windowed.cached = needle
            x = torch.tensor([ids + answer], device=device)
            logits = model(input_ids=x, use_cache=False, logits_to_keep=len(answer) + 1).logits[0, :-1].float()
            target = torch.tensor(answer, device=device)
            nll += torch.nn.functional.cross_entropy(logits, target).item()
            right += bool((logits.argmax(-1) == target).all())
    Windowed.cached = None
    return nll / len(trials), right / len(trials)


def needle_positions(tok, trial) -> torch.Tensor:
    """The token positions of the trial's needle sentence in its ids."""
    text = passkey.NEEDLE.format(key=trial.answer)
    start = trial.prompt.index(text)
    enc = tok(trial.prompt, return_offsets_mapping=True)
    if list(enc.input_ids) != list(trial.ids):
        raise SystemExit("window_recall: the prompt's offsets do not tokenize to its ids")
    return torch.tensor([i for i, (a, b) in enumerate(enc["offset_mapping"])
                         if b > start and a < start + len(text)])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sinks", type=int, default=0, help="first tokens every windowed layer also sees")
    p.add_argument("--oracle", action="store_true", help="every windowed layer also sees the needle sentence")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    teacher, tok = load_teacher(a.teacher, device=device)
    model = convert(teacher, "lolcats", inplace=True)
    layers = sorted(mixers(model))
    trials = []
    for length in a.lengths:
        for depth in DEFAULT_DEPTHS:
            for i in range(a.trials):
                t = passkey.make_trial(tok, length, length, depth, i, 1234)
                answer = tok(" " + t.answer, add_special_tokens=False).input_ids
                trials.append((list(t.ids), answer, needle_positions(tok, t) if a.oracle else None))
    t0 = time.time()
    record = {"lengths": a.lengths, "trials": len(trials), "window": a.window, "sinks": a.sinks, "oracle": a.oracle}
    record["all_global"] = score(model, trials, layers, a.window, device, a.sinks)
    record["all_window"] = score(model, trials, [], a.window, device, a.sinks)
    print("all global", record["all_global"], "all window", record["all_window"], f"{time.time() - t0:.0f}s", flush=True)
    chosen, rounds = [], []
    for r in range(a.rounds):
        scores = {i: score(model, trials, chosen + [i], a.window, device, a.sinks) for i in layers if i not in chosen}
        best = min(scores, key=lambda i: (scores[i][0], i))
        rounds.append({"chosen": list(chosen), "scores": {str(i): v for i, v in scores.items()}})
        chosen.append(best)
        top = sorted(scores.items(), key=lambda kv: kv[1][0])[:6]
        print(f"round {r + 1}: +{best} -> {scores[best]}; top {top}; {time.time() - t0:.0f}s", flush=True)
    record["rounds"], record["chosen"] = rounds, chosen
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
