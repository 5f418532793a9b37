"""Attention-weight maps: the teacher's softmax weights beside the learned mixer's, per head
(the pictures of LoLCATs Figs. 9-11).

For a converted model, both come from the same layer input: the mixer's own q/k projections give
the softmax weights its teacher layer computed (``distill.probes.softmax_attention_of``'s math) and the
mixer's normalised weights (``Mixer.attention_weights``: the hybrid's window + linear weights, or
the linear attention's). Kinds without normalised weights (decayed or GroupNorm-ed mixers such as
SUPRA, RetNet, Mamba) have nothing comparable and are skipped with a reason.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import ops
from ..convert import mixers
from ..errors import LinearizeError


@torch.no_grad()
def attention_weights(model, ids: torch.Tensor, layers=None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (teacher [H, T, T], mixer [H, T, T])}`` for the first sequence of ``ids``."""
    found = mixers(model)
    if not found:
        raise LinearizeError("attention maps need a converted model (no linear mixer found)")
    layers = sorted(found) if layers is None else list(layers)
    captured = {}

    def grab(idx):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            captured[idx] = (hidden[:1], kwargs.get("position_embeddings"))
        return hook

    handles = [found[i].register_forward_pre_hook(grab(i), with_kwargs=True) for i in layers if i in found]
    try:
        model(ids[:1].to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    maps = {}
    for i in layers:
        m = found[i]
        hidden, pe = captured[i]
        pe = None if pe is None else tuple(x[:1] for x in pe)
        q, k, _ = m.adapter.qkv(m, hidden)
        try:
            mine = m.attention_weights(q, k, pe)[0].float().cpu()
        except LinearizeError:
            continue  # this kind has no normalised weights
        qr, kr = m.adapter.rope(m, q, k, pe)
        g = m.geometry
        teacher = ops.softmax_attention_weights(qr, kr, scale=g.scaling, softcap=g.softcap, window=g.sliding_window)
        maps[i] = (teacher[0].float().cpu(), mine)
    if not maps:
        kinds = sorted({found[i].kind for i in layers if i in found})
        raise LinearizeError(f"the {', '.join(kinds)} mixer has no normalised attention weights to draw")
    return maps


def attention_map_plot(model, ids: torch.Tensor, out_png: str | Path, layers=None, heads=(0, 1),
                       title: str | None = None) -> Path:
    """A grid of heatmaps: one row per (layer, head), teacher softmax | learned mixer."""
    from .plots import _pyplot

    maps = attention_weights(model, ids, layers)
    rows = [(layer, h) for layer in sorted(maps) for h in heads if h < maps[layer][0].shape[0]]
    plt = _pyplot()  # one clear error when matplotlib is missing
    from matplotlib.colors import PowerNorm

    fig, axes = plt.subplots(len(rows), 2, figsize=(8, 3.8 * len(rows)), squeeze=False)
    for r, (layer, h) in enumerate(rows):
        teacher, mine = maps[layer]
        # the first queries have few keys and weights near 1: leave them out of the colour scale
        vmax = float(teacher[h][min(4, teacher.shape[1] - 1):].max())
        for c, (name, w) in enumerate((("teacher softmax", teacher), ("learned mixer", mine))):
            ax = axes[r][c]
            # a power scale: most weights are small next to the attention sink and the diagonal
            ax.imshow(w[h].numpy(), cmap="viridis", norm=PowerNorm(0.4, vmin=0.0, vmax=vmax))
            ax.set_title(f"layer {layer} head {h}: {name}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)
