"""Do a window layer's attention sinks hold past the teacher's context? A CPU stand-in (#53, the default at 32k).

The teacher (the embedded SmolLM2-135M, context 8,192) with the default student's 14 kept layers as softmax over
their windows (1, 2, 18, 20 over 4,160; the others over 1,280) and every other layer over its last 64 tokens (the
hybrid's window, its linear terms left out), each layer also seeing the first 4 tokens (attention sinks). ``raw``:
the sinks scored from each query's own position (their distance grows past anything the teacher's RoPE saw);
``cap``: from ``min(p, --cap)`` (``mixers/window.py``'s reach). Prints perplexity by position on ``--domains``
(``--blocks`` blocks of ``--length`` tokens); ``--out`` writes the rows as JSON.

    PYTHONPATH=src python dev/sink_reach.py --length 32768 --domains books,technical --out reach.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import nn

from linearize.convert import convert
from linearize.distill.probes import swapped
from linearize.eval.domains import DOMAINS
from linearize.eval.perplexity import source_blocks
from linearize.teacher import load_teacher

KEPT = {1: 4160, 2: 4160, 7: 1280, 8: 1280, 10: 1280, 11: 1280, 12: 1280, 14: 1280, 15: 1280, 17: 1280, 18: 4160,
        19: 1280, 20: 4160, 23: 1280}  # lolcats_tiers' choice on SmolLM2-135M (H200, 2026-11-30)


class Windowed(nn.Module):
    """Softmax over the last ``window`` keys and the first ``sinks`` once they have left it; the sinks scored by
    the query rotated at ``min(p, cap)`` (``cap`` None: at ``p``). Queries in chunks of 1,024."""

    rotary = None  # the teacher's rotary embedding

    def __init__(self, m, window, sinks, cap):
        super().__init__()
        self.m, self.window, self.sinks, self.cap = m, window, sinks, cap

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        m = self.m
        q, k, v = m.adapter.qkv(m, hidden_states)
        qr, kr = m.adapter.rope(m, q, k, position_embeddings)
        t = qr.shape[2]
        group = qr.shape[1] // kr.shape[1]
        kr, v = kr.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        pos = torch.arange(t)
        qs = qr
        if self.cap is not None:
            qs = m.adapter.rope(m, q, k, Windowed.rotary(hidden_states, pos.clamp(max=self.cap)[None]))[0]
        out = torch.empty_like(qr)
        s = self.sinks
        for lo_q in range(0, t, 1024):
            hi_q = min(t, lo_q + 1024)
            lo = max(0, lo_q - self.window + 1)
            dist = pos[lo_q:hi_q, None] - pos[None, lo:hi_q]
            scores = (qr[:, :, lo_q:hi_q] @ kr[:, :, lo:hi_q].transpose(-1, -2)) * m.geometry.scaling
            scores = scores.masked_fill(~((dist >= 0) & (dist < self.window)), float("-inf"))
            far = (pos[lo_q:hi_q, None] - pos[None, :s]) >= self.window
            sink = (qs[:, :, lo_q:hi_q] @ kr[:, :, :s].transpose(-1, -2)) * m.geometry.scaling
            w = torch.softmax(torch.cat([sink.masked_fill(~far, float("-inf")), scores], -1).float(), -1).to(v.dtype)
            out[:, :, lo_q:hi_q] = w[..., :s] @ v[:, :, :s] + w[..., s:] @ v[:, :, lo:hi_q]
        return m.adapter.out(m, out), None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--blocks", type=int, default=1)
    p.add_argument("--domains", default="books,technical")
    p.add_argument("--settings", default="raw,cap")
    p.add_argument("--cap", type=int, default=8191, help="the reach: the teacher's context less one")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--out")
    a = p.parse_args()
    teacher, tok = load_teacher(None, device="cpu")
    Windowed.rotary = teacher.model.rotary_emb
    model = convert(teacher, "lolcats", inplace=True)
    edges = [e for e in (0, 256, 1024, 4096, 8192, 12288, 16384, 32768) if e < a.length] + [a.length]
    rows = []
    for name in a.domains.split(","):
        domain = DOMAINS[name]
        blocks = source_blocks(domain.source, tok, a.length, domain.split, a.blocks)
        for setting in a.settings.split(","):
            cap = a.cap if setting == "cap" else None
            start, nll = time.time(), torch.zeros(a.length - 1)
            with torch.no_grad(), swapped(model, lambda m: Windowed(m, KEPT.get(m.layer_idx, 64), a.sinks, cap)):
                for block in blocks:
                    logits = model(input_ids=block[None], use_cache=False).logits[0, :-1].float()
                    nll += nn.functional.cross_entropy(logits, block[1:], reduction="none")
            nll /= len(blocks)
            by = {f"{lo}-{hi}": round(math.exp(float(nll[lo:hi - 1].mean())), 2) for lo, hi in zip(edges, edges[1:])}
            rows.append({"domain": name, "setting": setting, "ppl_by_position": by, "blocks": len(blocks),
                         "seconds": round(time.time() - start)})
            print(name, setting, by, flush=True)
    if a.out:
        json.dump({"args": vars(a), "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
