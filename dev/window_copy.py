"""How many of the teacher's layers must see far back for it to copy? A ceiling for window-softmax layers (#53).

The teacher runs with softmax over the last ``--window`` tokens (the LoLCATs student's window; ``--sinks N``:
and the first N, as StreamingLLM keeps) in every layer but K, which see ``--kept-window`` tokens (default: all;
``--kept-sinks N``: and the first N). Scored on ``linearize eval --tasks copy``'s prompts (held-out books:
passage, gap, passage; the same seeded trials): teacher-forced accuracy on the repeat, by gap. ``--ks``: the K
layers whose heads copy most in the whole teacher, by **induction score** (the largest over a layer's heads
of the mean attention a repeat token pays to the token after its first occurrence) or ``--rank far`` (the
attention mass beyond the window and the sinks); ``--layers``: sets given by hand (``17@4160``: that layer over 4,160 tokens). ``--diffuse L``: windowed
layers L keep their weight beyond the window but spread it evenly over those keys (a crude linear state).
``--kept-fp8``: the K layers' keys and values as a float8 (e4m3) ring would hold them (a scale per token and head).
No student with K such layers copies further than their windows reach (its linear terms copy nothing), so
this bounds ``--keep-softmax auto:K --softmax-window W`` against the state cap.

    PYTHONPATH=src python dev/window_copy.py --sinks 4 --gaps 256 1024 4096 --ks 0 3 6 12 --trials 6 --out R.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn

from linearize.convert import convert
from linearize.convert.layers import mixers
from linearize.distill.probes import swapped
from linearize.eval.recall import greedy_guesses
from linearize.eval.tasks import copy as copy_task
from linearize.ops.softmax_attention import softmax_attention
from linearize.ops.window import window_softmax
from linearize.teacher import load_teacher


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, T, D] as a float8 (e4m3) store would give it back: a scale per token and head (absmax / 448)."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((x / scale).to(torch.float8_e4m3fn).to(x.dtype)) * scale


class Windowed(nn.Module):
    """The teacher's softmax attention from ``m``'s projections over the last ``window`` keys (None:
    all); with ``induction`` set to ``(start, first, length)``, records the layer's induction score."""

    induction: tuple[int, int, int] | None = None
    far: tuple[int, int] | None = None  # (window, sinks): record the attention mass beyond both
    scores: dict[int, list[float]] = {}

    def __init__(self, m, window, sinks=0, diffuse=False, fp8=False):
        super().__init__()
        self.mixer, self.config, self.window, self.sinks, self.diffuse, self.fp8 = m, m.config, window, sinks, diffuse, fp8

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        m = self.mixer
        q, k, v = m.adapter.qkv(m, hidden_states)
        qr, kr = m.adapter.rope(m, q, k, position_embeddings)
        g = m.geometry
        if self.fp8:
            kr, v = _fp8(kr), _fp8(v)
        if Windowed.induction is not None:
            self._score(qr, kr, g)
        if Windowed.far is not None:
            self._far(qr, kr, g)
        if self.diffuse:
            o = self._diffuse(qr, kr, v, g)
        elif self.window is None:
            o = softmax_attention(qr, kr, v, scale=g.scaling, softcap=g.softcap)
        elif self.sinks:  # the window and the first ``sinks`` tokens (StreamingLLM's attention sinks)
            pos = torch.arange(q.shape[2], device=q.device)
            dist = pos[:, None] - pos[None, :]
            allowed = (dist >= 0) & ((dist < self.window) | (pos < self.sinks)[None, :])
            o = torch.nn.functional.scaled_dot_product_attention(qr, kr, v, attn_mask=allowed, scale=g.scaling,
                                                                 enable_gqa=True)
        else:
            o = window_softmax(qr, kr, v, window=self.window, scale=g.scaling, softcap=g.softcap)
        return m.adapter.out(m, o), None

    def _score(self, q, k, g):
        start, first, length = Windowed.induction
        rows = torch.arange(start + 1, start + length - 1)  # repeat tokens with a successor in the passage
        target = first + (rows - start) + 1  # the token after the first occurrence of each
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = (q[0, :, rows] @ k[0].transpose(-1, -2)).float() * g.scaling
        if g.softcap:
            logits = g.softcap * torch.tanh(logits / g.softcap)
        causal = torch.arange(k.shape[2])[None, :] <= rows[:, None]
        probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        mass = probs[:, torch.arange(len(rows)), target].mean(-1)  # per head
        Windowed.scores.setdefault(self.mixer.layer_idx, []).append(mass.max().item())


    def _diffuse(self, q, k, v, g):
        """The softmax over all keys, but the weight beyond the window and the sinks spread evenly over those
        keys (the mass kept, its shape lost): a stand-in for a linear state that averages the far past."""
        n = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        logits = (q @ k.transpose(-1, -2)).float() * g.scaling
        if g.softcap:
            logits = g.softcap * torch.tanh(logits / g.softcap)
        pos = torch.arange(q.shape[2])
        dist = pos[:, None] - pos[None, :]
        probs = logits.masked_fill(dist < 0, float("-inf")).softmax(-1)
        beyond = (dist >= self.window) & (pos >= self.sinks)[None, :]
        mass = (probs * beyond).sum(-1, keepdim=True)
        even = beyond / beyond.sum(-1, keepdim=True).clamp(min=1)
        probs = probs * ~beyond + mass * even
        return (probs.to(v.dtype) @ v)

    def _far(self, q, k, g):
        window, sinks = Windowed.far
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        rows = torch.arange(window, q.shape[2])
        logits = (q[0, :, rows] @ k[0].transpose(-1, -2)).float() * g.scaling
        if g.softcap:
            logits = g.softcap * torch.tanh(logits / g.softcap)
        pos = torch.arange(k.shape[2])
        dist = rows[:, None] - pos[None, :]
        probs = logits.masked_fill(dist < 0, float("-inf")).softmax(-1)
        beyond = (dist >= window) & (pos >= sinks)[None, :]
        mass = (probs * beyond).sum(-1).mean(-1)  # per head
        Windowed.scores.setdefault(self.mixer.layer_idx, []).append(mass.max().item())


@torch.no_grad()
def accuracy(model, prompts, keep, window, kept_window, device, sinks=0, kept_sinks=0, diffuse=(), own=None, fp8=False):
    own = own or {}  # a window of a kept layer's own (``--layers 17@4160``)

    def kept(m):
        w = own.get(m.layer_idx, kept_window)
        return Windowed(m, w, kept_sinks if w else 0, fp8=fp8)

    with swapped(model, lambda m: kept(m) if m.layer_idx in keep
                 else Windowed(m, window, sinks, diffuse=m.layer_idx in diffuse)):
        hits = count = 0
        for p in prompts:
            g = greedy_guesses(model, [p.ids], [p.start + 1], device)[0]
            hits += sum(g[t] == p.ids[t] for t in range(p.start + 1, p.start + p.passage_len))
            count += p.passage_len - 1
    return hits / count


@torch.no_grad()
def layer_order(model, prompts, rank: str, window: int, sinks: int, device) -> list[tuple[int, float]]:
    """Layers by score, largest first, averaged over ``prompts`` (the whole teacher attending): ``induction``
    (attention from the repeat to the token after each first occurrence) or ``far`` (attention mass beyond the
    window and the sinks); each a layer's largest over its heads."""
    Windowed.scores = {}
    Windowed.far = (window, sinks) if rank == "far" else None
    with swapped(model, lambda m: Windowed(m, None)):
        for p in prompts:
            Windowed.induction = (p.start, p.first, p.passage_len) if rank == "induction" else None
            model(torch.tensor([p.ids], device=device), use_cache=False, logits_to_keep=1)
    Windowed.induction = Windowed.far = None
    mean = {i: sum(v) / len(v) for i, v in Windowed.scores.items()}
    return sorted(mean.items(), key=lambda kv: -kv[1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default=None)
    p.add_argument("--gaps", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--passage", type=int, default=64)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--ks", type=int, nargs="+", default=[0, 2, 4, 6])
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--kept-window", type=int, default=None)
    p.add_argument("--sinks", type=int, default=0, help="first tokens every windowed layer also sees")
    p.add_argument("--kept-sinks", type=int, default=0, help="first tokens the K layers also see (--kept-window)")
    p.add_argument("--layers", default=None, help="explicit sets of far-seeing layers instead of --ks: '11,8;0,5,6'")
    p.add_argument("--diffuse", default="", help="layers (not kept) whose weight beyond the window is spread evenly: '0,1'")
    p.add_argument("--kept-fp8", action="store_true", help="the K layers read their keys and values through float8")
    p.add_argument("--rank", choices=("induction", "far"), default="induction",
                   help="how --ks picks its layers: induction score, or attention mass beyond the window and sinks")
    p.add_argument("--rank-gap", type=int, default=1024, help="gap of the prompts the induction scores come from")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    teacher, tok = load_teacher(a.teacher, device=device)
    model = convert(teacher, "lolcats", inplace=True)
    layers = sorted(mixers(model))
    stream = copy_task.held_out_ids(tok)
    prefix = [tok.bos_token_id] if tok.bos_token_id is not None else []
    cells = {g: [copy_task.make_prompt(stream, a.passage, g, i, 1234, prefix) for i in range(a.trials)] for g in a.gaps}
    rank_prompts = [copy_task.make_prompt(stream, a.passage, a.rank_gap, i, 4321, prefix) for i in range(a.trials)]
    t0 = time.time()
    order = layer_order(model, rank_prompts, a.rank, a.window, a.sinks, device)
    print(f"{a.rank} scores", [(i, round(s, 3)) for i, s in order], f"{time.time() - t0:.0f}s", flush=True)
    record = {"teacher": a.teacher or "default", "passage": a.passage, "trials": a.trials, "window": a.window,
              "kept_window": a.kept_window, "rank": a.rank, "sinks": a.sinks, "kept_sinks": a.kept_sinks, "diffuse": a.diffuse, "kept_fp8": a.kept_fp8, "order": order, "rows": []}
    # each set's own windows (``17@4160``), apart: a layer may have one in one set and not in another
    owns = [{int(i.split("@")[0]): int(i.split("@")[1]) for i in part.split(",") if "@" in i}
            for part in a.layers.split(";")] if a.layers else [{} for _ in a.ks]
    sets = ([{int(i.split("@")[0]) for i in part.split(",")} for part in a.layers.split(";")] if a.layers else
            [set(layers) if k >= len(layers) else {i for i, _ in order[:k]} for k in a.ks])
    for keep, own in zip(sets, owns):
        k = len(keep)
        row = {"k": k, "layers": sorted(keep), "own_windows": {str(i): w for i, w in own.items() if i in keep},
               "accuracy": {}}
        for g, prompts in cells.items():
            row["accuracy"][g] = accuracy(model, prompts, keep, a.window, a.kept_window, device, a.sinks, a.kept_sinks,
                                         {int(i) for i in a.diffuse.split(",") if i}, own, a.kept_fp8)
        record["rows"].append(row)
        print(f"K={k:2d} {sorted(keep) if k < len(layers) else 'all'}: "
              + " ".join(f"{g}: {v:.3f}" for g, v in row["accuracy"].items()), f"{time.time() - t0:.0f}s", flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
