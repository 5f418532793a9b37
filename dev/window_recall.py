"""Which of the teacher's layers must see far for recall, and how far? A ceiling for window-softmax students (#53).

The teacher runs with sliding-window softmax over the last ``--window`` tokens (the student's hybrid window,
its linear terms left out) in every layer but a set K, which keeps full causal softmax, or with
``--kept-window W`` softmax over its last W tokens (a layer's own: ``I@W``). Passkey prompts (``linearize eval
--tasks passkey``'s) are scored teacher-forced: the answer's digits all argmax-right = correct, and their mean
NLL, by length.

* Without ``--layers``: K grows greedily, each round by the layer whose move to ``--promote`` (default: the
  kept window) lowers the answer's mean NLL most (over ``--select-length``'s trials only, if given), from
  ``--start`` (default: no layer) among ``--pool`` (default: every layer). First the search's two ends are
  scored (the start; every pool layer promoted), at the end the chosen set at every length. The default
  (every layer windowed, then K layers turning global) bounds ``keep_softmax: auto:K``.
* ``--layers 'SPEC;SPEC'``: those sets, a row each. A SPEC is comma-separated layer indices, ``I@W`` with a
  window of its own (``I@full``: every earlier key), ``all`` (every layer; ``all@W``: over W) or ``none``.

What the teacher cannot recall with a set, a student with those softmax layers and windows recalls only
through its linear terms, which this leaves out. ``--sinks N``: the ``--window`` layers also see the first N
tokens. ``--oracle``: every layer with a window also sees the needle sentence's tokens ("The pass key is N.
Remember it."), as an exact cache that kept exactly the needle would: a ceiling for any rule that picks which
tokens a sparse cache keeps (``sparse_cache``) beside the window.

    PYTHONPATH=src python dev/window_recall.py --lengths 1024 2048 --trials 2 --rounds 2 [--teacher T]
    PYTHONPATH=src python dev/window_recall.py --lengths 2048 4096 --kept-window 1280 --layers 'all;1,2@4160,7@4160'
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
from linearize.eval.tasks import passkey
from linearize.eval.tasks.needle import DEFAULT_DEPTHS
from linearize.ops.softmax_attention import softmax_attention
from linearize.ops.window import window_softmax
from linearize.teacher import load_teacher

FULL = None  # a layer's window: every earlier key


class Windowed(nn.Module):
    """The teacher's softmax attention from ``m``'s projections over the last ``window`` keys (and
    the first ``sinks``, as StreamingLLM keeps; and ``cached`` if ``oracle``); ``window`` None: every earlier key."""

    cached: torch.Tensor | None = None  # positions every oracle layer also sees (``--oracle``), set per prompt

    def __init__(self, m, window, sinks=0, oracle=False):
        super().__init__()
        self.mixer, self.config, self.window, self.sinks, self.oracle = m, m.config, window, sinks, oracle

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        m = self.mixer
        q, k, v = m.adapter.qkv(m, hidden_states)
        qr, kr = m.adapter.rope(m, q, k, position_embeddings)
        g = m.geometry
        cached = Windowed.cached if self.oracle else None
        if self.window is None or self.window >= q.shape[2]:
            o = softmax_attention(qr, kr, v, scale=g.scaling, softcap=g.softcap)
        elif not self.sinks and cached is None:
            o = window_softmax(qr, kr, v, window=self.window, scale=g.scaling, softcap=g.softcap)
        else:
            pos = torch.arange(q.shape[2], device=q.device)
            dist = pos[:, None] - pos[None, :]
            seen = pos < self.sinks
            if cached is not None:
                seen = seen | torch.isin(pos, cached.to(pos.device))
            allowed = (dist >= 0) & ((dist < self.window) | seen[None, :])
            o = torch.nn.functional.scaled_dot_product_attention(qr, kr, v, attn_mask=allowed, scale=g.scaling,
                                                                 enable_gqa=True)
        return m.adapter.out(m, o), None


def parse_window(text: str):
    return FULL if text in ("full", "0") else int(text)


def parse_set(spec: str, layers: list[int], kept_window) -> dict[int, int | None]:
    """``{layer: window}`` of a SPEC: ``'1,2@4160,3'`` (bare indices take ``kept_window``), ``all[@W]`` or ``none``."""
    spec = spec.strip()
    if spec == "all" or spec.startswith("all@"):
        return {i: parse_window(spec[4:]) if spec != "all" else kept_window for i in layers}
    if spec in ("none", ""):
        return {}
    kept = {}
    for part in spec.split(","):
        index, _, own = part.strip().partition("@")
        if int(index) not in layers:
            raise SystemExit(f"window_recall: no layer {index} (layers {layers[0]}..{layers[-1]})")
        kept[int(index)] = parse_window(own) if own else kept_window
    return kept


def format_set(kept: dict, layers: list[int], kept_window) -> str:
    """The SPEC of ``kept`` (windows other than ``kept_window`` written ``@W``)."""
    if not kept:
        return "none"
    own = lambda w: "" if w == kept_window else "@" + ("full" if w is FULL else str(w))  # noqa: E731
    if sorted(kept) == layers and len(set(kept.values())) == 1:
        return "all" + own(kept[layers[0]])
    return ",".join(f"{i}{own(kept[i])}" for i in sorted(kept))


@torch.no_grad()
def score(model, trials, kept: dict, window, device, sinks=0, oracle=False):
    """Per trial ``(length, answer NLL, all digits right)``: layers in ``kept`` over their own windows, the
    others over ``window`` (and ``sinks``)."""
    out = []
    make = lambda m: (Windowed(m, kept[m.layer_idx], 0, oracle) if m.layer_idx in kept  # noqa: E731
                      else Windowed(m, window, sinks, oracle))
    with swapped(model, make):
        for length, ids, answer, needle in trials:
            Windowed.cached = needle
            x = torch.tensor([ids + answer], device=device)
            logits = model(input_ids=x, use_cache=False, logits_to_keep=len(answer) + 1).logits[0, :-1].float()
            target = torch.tensor(answer, device=device)
            out.append((length, torch.nn.functional.cross_entropy(logits, target).item(),
                        bool((logits.argmax(-1) == target).all())))
    Windowed.cached = None
    return out


def summarize(per_trial) -> dict:
    """``{"nll", "accuracy", "by_length": {L: {"nll", "accuracy", "trials"}}}`` of ``score``'s output."""
    def stats(rows):
        return {"nll": sum(r[1] for r in rows) / len(rows), "accuracy": sum(r[2] for r in rows) / len(rows),
                "trials": len(rows)}

    lengths = sorted({r[0] for r in per_trial})
    return {**stats(per_trial), "by_length": {L: stats([r for r in per_trial if r[0] == L]) for L in lengths}}


def row_text(name: str, s: dict, lengths, seconds=None, forwards=None) -> str:
    acc = " ".join(f"{s['by_length'][L]['accuracy'] * 100:5.0f}" if L in s["by_length"] else "    -" for L in lengths)
    nll = " ".join(f"{s['by_length'][L]['nll']:6.3f}" if L in s["by_length"] else "     -" for L in lengths)
    tail = f"  {seconds:.0f}s, {seconds / forwards:.1f}s/forward" if seconds is not None else ""
    return f"{acc} | {nll} | {name}{tail}"


def header(lengths) -> str:
    return (" ".join(f"{L:>5}" for L in lengths) + " | " + " ".join(f"{L:>6}" for L in lengths)
            + " | set (accuracy % | mean answer NLL, by length)")


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Layers not in a set run softmax over --window tokens (+ --sinks).")
    p.add_argument("--teacher", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="passkey prompt lengths (tokens)")
    p.add_argument("--trials", type=int, default=2, help="trials per (length, depth); 5 depths")
    p.add_argument("--window", type=int, default=64,
                   help="window of every layer outside the set (the student's hybrid window)")
    p.add_argument("--kept-window", type=parse_window, default=FULL,
                   help="window of the set's layers without an @W of their own (default: full causal attention)")
    p.add_argument("--layers", default=None,
                   help="sets to score instead of the greedy search, ';'-separated: '1,2@4160,3;all@full;none'")
    p.add_argument("--rounds", type=int, default=2, help="greedy rounds")
    p.add_argument("--start", default="none", help="greedy: the set to start from (a SPEC)")
    p.add_argument("--pool", default="all", help="greedy: the layers to choose among (a SPEC; windows ignored)")
    p.add_argument("--promote", default=None,
                   help="greedy: the window a chosen layer gets (default: --kept-window; 'full')")
    p.add_argument("--select-length", type=int, default=None,
                   help="greedy: choose by the NLL of this length's trials alone (and score only those)")
    p.add_argument("--sinks", type=int, default=0, help="first tokens every --window layer also sees")
    p.add_argument("--oracle", action="store_true", help="every layer with a window also sees the needle sentence")
    p.add_argument("--out", default=None, help="JSON record")
    a = p.parse_args()
    promote = a.kept_window if a.promote is None else parse_window(a.promote)
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
                trials.append((length, list(t.ids), answer, needle_positions(tok, t) if a.oracle else None))
    args = (a.window, device, a.sinks, a.oracle)
    record = {"lengths": a.lengths, "trials": len(trials), "window": a.window, "kept_window": a.kept_window,
              "sinks": a.sinks, "oracle": a.oracle, "rows": []}
    t0 = time.time()

    def run_row(kept, trials_=trials):
        t = time.time()
        s = summarize(score(model, trials_, kept, *args))
        name = format_set(kept, layers, a.kept_window)
        row = {"set": name, "layers": {str(i): w for i, w in sorted(kept.items())}, **s,
               "seconds": time.time() - t}
        record["rows"].append(row)
        print(row_text(name, s, a.lengths, row["seconds"], len(trials_)), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(record, f, indent=1)
        return row

    print(header(a.lengths), flush=True)
    if a.layers:
        for spec in a.layers.split(";"):
            run_row(parse_set(spec, layers, a.kept_window))
    else:
        current = parse_set(a.start, layers, a.kept_window)
        pool = sorted(parse_set(a.pool, layers, a.kept_window))
        search = [t for t in trials if a.select_length in (None, t[0])]
        if not search:
            raise SystemExit(f"window_recall: no trials of --select-length {a.select_length}")
        # the search's two ends, on its trials (the default: every layer global, every layer windowed)
        record["pool_promoted"] = run_row({**current, **{i: promote for i in pool}}, search)
        record["start"] = run_row(dict(current), search)
        rounds = []
        for r in range(a.rounds):
            candidates = [i for i in pool if current.get(i, "windowed") != promote]
            if not candidates:
                break
            scores = {i: summarize(score(model, search, {**current, i: promote}, *args)) for i in candidates}
            best = min(scores, key=lambda i: (scores[i]["nll"], i))
            rounds.append({"from": format_set(current, layers, a.kept_window), "chosen": best,
                           "scores": {str(i): {"nll": v["nll"], "accuracy": v["accuracy"]} for i, v in scores.items()}})
            current[best] = promote
            top = sorted(scores.items(), key=lambda kv: kv[1]["nll"])[:6]
            print(f"round {r + 1}: +{best} -> nll {scores[best]['nll']:.3f} acc {scores[best]['accuracy']:.2f}; top "
                  + ", ".join(f"{i}: {v['nll']:.3f}/{v['accuracy']:.2f}" for i, v in top)
                  + f"; {time.time() - t0:.0f}s", flush=True)
        record["rounds"] = rounds
        record["chosen"] = [r["chosen"] for r in rounds]
        record["final"] = run_row(current)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(record, f, indent=1)
    print(f"{time.time() - t0:.0f}s in all", flush=True)


if __name__ == "__main__":
    main()
