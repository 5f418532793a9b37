"""Do the window-softmax layers a student keeps need attention sinks past their window? A stand-in on the CPU (#53).

The teacher runs with softmax over its last ``--kept-window`` tokens in the ``--kept`` layers (the default student's
choice on SmolLM2-135M), with or without the sequence's first ``--sinks`` tokens beside them (StreamingLLM's attention
sinks), and every other layer over its last ``--window`` tokens + the first ``--sinks`` (the hybrid's window, its
linear terms left out); the teacher itself first. Prints the mean NLL by position on the held-out code and technical
domains (``--blocks`` blocks of ``--length`` tokens each), a row per setting; ``--out`` writes them as JSON.

    PYTHONPATH=src python dev/window_sinks.py --length 8192 --blocks 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from window_recall import Windowed  # noqa: E402

from linearize.convert import convert  # noqa: E402
from linearize.distill.probes import swapped  # noqa: E402
from linearize.eval.domains import DOMAINS  # noqa: E402
from linearize.eval.perplexity import source_blocks  # noqa: E402
from linearize.teacher import load_teacher  # noqa: E402

KEPT = "1,2,3,6,7,11,15,16,17,18,19,20,22,23"  # lolcats_wide's auto:14 by recall on SmolLM2-135M (H200 runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default=None)
    p.add_argument("--kept", default=KEPT, help="comma-separated layers kept over --kept-window")
    p.add_argument("--kept-window", type=int, default=1280)
    p.add_argument("--window", type=int, default=64, help="the other layers' window")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--domains", default="code,technical")
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    teacher, tok = load_teacher(a.teacher, device="cpu")
    model = convert(teacher, "lolcats", inplace=True)
    kept = {int(i) for i in a.kept.split(",")}
    edges = [e for e in (0, 256, 1024, 2048, 4096, 8192, 16384, 32768) if e < a.length] + [a.length]
    settings = {
        "teacher": lambda m: Windowed(m, None),
        f"kept over {a.kept_window}": lambda m: (Windowed(m, a.kept_window) if m.layer_idx in kept
                                                 else Windowed(m, a.window, a.sinks)),
        f"kept over {a.kept_window} + {a.sinks} sinks": lambda m: (Windowed(m, a.kept_window, a.sinks)
                                                                   if m.layer_idx in kept
                                                                   else Windowed(m, a.window, a.sinks)),
    }
    rows = []
    for name in a.domains.split(","):
        domain = DOMAINS[name]
        blocks = source_blocks(domain.source, tok, a.length, domain.split, a.blocks)
        for setting, make in settings.items():
            start = time.time()
            nll = torch.zeros(a.length - 1)
            with torch.no_grad(), swapped(model, make):
                for block in blocks:
                    logits = model(input_ids=block[None], use_cache=False).logits[0, :-1].float()
                    nll += torch.nn.functional.cross_entropy(logits, block[1:], reduction="none")
            nll /= len(blocks)
            by = {f"{lo}-{hi}": round(float(nll[lo:hi - 1].mean()), 4) for lo, hi in zip(edges, edges[1:])}
            rows.append({"domain": name, "setting": setting, "nll_by_position": by, "blocks": int(len(blocks)),
                         "seconds": round(time.time() - start, 1)})
            print(name, setting, by, flush=True)
    if a.out:
        json.dump({"args": vars(a), "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
