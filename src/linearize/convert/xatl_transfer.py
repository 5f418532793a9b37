"""XATL: build a linear-cost architecture from a teacher's shared weights (cross-architecture transfer).

The student keeps the teacher's shape (hidden size, FFN, layers, vocabulary) and its own modules
where the two architectures share them; the token mixer of every layer is replaced by a new one:

- ``retnet``: multi-scale retention (``mixers/retnet.py``), the teacher's W_O kept under its name;
- ``striped_mamba`` (alias ``mamba``): a Mamba mixer in each block, the FFN kept (XATL §4.1);
- either with softmax attention kept at some layers (``keep_softmax``; ``"xatl"``: layers 2 and
  N//2, XATL §3.2).

The architectures are the mixer kinds of role ``build`` in ``linearize/kinds.py``.

A transfer map, chosen by the user, says which shared weights start from the teacher; every other
tensor is initialised fresh (the teacher family's own initialiser with the config's
``initializer_range``; the new mixers' weights are always fresh). Layer norms travel with the
weights that follow them:

=============  ==========================================================================
``embeddings``  input and output embeddings, and the final norm (which feeds the output one)
``ffn``         every layer's FFN and the norm(s) around it (``post_attention_layernorm`` in the
                Llama family; Gemma 2/3's pre/post-feedforward norms)
``wo``          the mixers' output projection W_O and the attention norm(s) before it
                (``input_layernorm``; Gemma 2/3 also ``post_attention_layernorm``). RetNet only:
                Mamba's output projection reads 2 x hidden features and cannot take W_O, so
                the norm before a Mamba mixer is always fresh (reported under ``wo``)
``qkv``         RetNet only: the retention's W_Q, W_K, W_V from the same layer's teacher attention
                (``mixers/retnet.py`` documents the mapping: values exact, grouped-query heads
                repeated; queries and keys keep half of each head's RoPE pairs). An initialisation
                of the new mixer, as MambaInLlama starts Mamba from attention: these weights always
                train (frozen and LIT do not freeze them); W_G and the GroupNorm stay fresh.
                With ``wo``: the teacher's q/k/v/o
``attention``   the whole softmax attention layers that stay (``keep_softmax``), with their norms
=============  ==========================================================================

``transfer=()`` (or ``"scratch"``) transfers nothing: embeddings, norms, FFN, everything is fresh.
The default is ``embeddings, ffn`` plus ``wo`` where the mixer keeps the teacher's W_O (RetNet,
not Mamba), plus ``attention`` when softmax layers are kept (``qkv`` is opt-in).

The structure is an ordinary spec (``kind`` and ``keep_softmax``), so ``linearize.save``/``load``
rebuild it; the XATL choices are recorded beside it as ``config.linearize["xatl"]``. Freezing the
transferred weights (frozen / unfrozen / LIT) is a training choice: see ``linearize.recipes.lit``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .. import kinds
from ..errors import LinearizeError
from ..mixers.fresh import FreshMixer
from ..models import get_adapter
from . import convert  # the function (this package's __init__)

ARCHITECTURES = kinds.architectures()  # name or alias -> mixer kind (the kinds of role "build")
TRANSFERS = ("embeddings", "ffn", "wo", "qkv", "attention")
MIXER_INIT = ("qkv",)  # items that initialise the new mixers: trained like them, never frozen
SCRATCH = ("scratch", "none", "")


def keeps_teacher_output(kind: str) -> bool:
    """Whether the ``kind`` mixer keeps the teacher's W_O (so ``wo`` can be transferred)."""
    return bool(getattr(kinds.mixer_class(kind), "keeps_output", False))


def takes_teacher_qkv(kind: str) -> bool:
    """Whether the ``kind`` mixer can start its q/k/v from the teacher's attention (``qkv``)."""
    return bool(getattr(kinds.mixer_class(kind), "teacher_qkv", ()))


def default_transfer(kind: str) -> tuple[str, ...]:
    """``embeddings, ffn``, plus ``wo`` where the mixer keeps the teacher's W_O."""
    return ("embeddings", "ffn") + (("wo",) if keeps_teacher_output(kind) else ())


DEFAULT_TRANSFER = {kind: default_transfer(kind) for kind in kinds.names("build")}

_FFN_NORMS = {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
_ATTENTION_NORMS = {"input_layernorm"}


def xatl_softmax_layers(n_layers: int) -> tuple[int, ...]:
    """XATL §3.2: softmax attention stays at layers 2 and N // 2 (0-based)."""
    if n_layers < 3:
        raise LinearizeError(f"keep_softmax 'xatl' keeps softmax at layers 2 and N/2: the model has only {n_layers} layers")
    return tuple(sorted({2, n_layers // 2}))


def parse_keep_softmax(keep_softmax) -> tuple[int, ...] | str:
    """``keep_softmax`` checked without the model: ``"xatl"``, or layer indices (a list or a string
    like ``"2,15"``) as a sorted tuple; None -> ()."""
    if keep_softmax is None:
        return ()
    if isinstance(keep_softmax, str):
        text = keep_softmax.replace(" ", "")
        if text.lower() == "xatl":
            return "xatl"
        keep_softmax = [x for x in text.split(",") if x]
    try:
        layers = tuple(sorted({int(i) for i in keep_softmax}))
    except (TypeError, ValueError):
        raise LinearizeError(f"keep_softmax must be 'xatl' or layer indices like 2,15, got {keep_softmax!r}") from None
    if any(i < 0 for i in layers):
        raise LinearizeError(f"keep_softmax layer indices must be >= 0, got {list(layers)}")
    return layers


def resolve_keep_softmax(keep_softmax, n_layers: int) -> tuple[int, ...]:
    """None / () -> none; ``"xatl"`` -> (2, N//2); indices as a list or a string like ``"2,15"``."""
    layers = parse_keep_softmax(keep_softmax)
    if layers == "xatl":
        return xatl_softmax_layers(n_layers)
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise LinearizeError(f"keep_softmax layers {bad} out of range: the model has layers 0..{n_layers - 1}")
    return layers



def resolve_transfer(transfer, kind: str, keep_softmax) -> tuple[str, ...]:
    """The transfer map as a tuple of ``TRANSFERS`` items, checked against the architecture
    (``keep_softmax``: the layers that stay softmax attention, or anything true when some do)."""
    if transfer is None:
        items = default_transfer(kind) + (("attention",) if keep_softmax else ())
    else:
        if isinstance(transfer, str):
            transfer = () if transfer.strip().lower() in SCRATCH else [x for x in transfer.replace(" ", "").split(",") if x]
        items = tuple(transfer)
    unknown = [x for x in items if x not in TRANSFERS]
    if unknown:
        raise LinearizeError(f"unknown transfer item(s) {', '.join(map(str, unknown))}; accepted: "
                             f"{', '.join(TRANSFERS)} (or scratch for none)")
    if "wo" in items and not keeps_teacher_output(kind):
        raise LinearizeError(f"W_O cannot be transferred to {kind}: its output projection reads other features than "
                             "the teacher's W_O (Mamba's reads 2 x hidden; transfer embeddings, ffn and, with keep_softmax, "
                             "attention)")
    if "qkv" in items and not takes_teacher_qkv(kind):
        raise LinearizeError(f"q/k/v cannot be transferred to {kind}: its mixer has no counterpart of the teacher's "
                             "q/k/v projections (retnet has)")
    if "attention" in items and not keep_softmax:
        raise LinearizeError("transfer 'attention' copies the kept softmax layers: give keep_softmax layers")
    return tuple(x for x in TRANSFERS if x in items)  # canonical order, no repeats


@dataclass
class XatlReport:
    """What ``build_xatl`` did: which parameters were copied from the teacher and which are fresh.

    ``copied`` and ``reinitialised`` map a transfer item to parameter names (as in
    ``student.named_parameters()``, tied weights once); ``new`` lists the mixers' own parameters,
    which never exist in the teacher. ``fresh`` = ``new`` + every reinitialised name.
    """

    kind: str
    transfer: tuple[str, ...]
    keep_softmax: tuple[int, ...]
    n_layers: int
    copied: dict[str, list[str]] = field(default_factory=dict)
    reinitialised: dict[str, list[str]] = field(default_factory=dict)
    new: list[str] = field(default_factory=list)
    numel: dict[str, int] = field(default_factory=dict)

    @property
    def copied_names(self) -> list[str]:
        return [n for names in self.copied.values() for n in names]

    @property
    def fresh(self) -> list[str]:
        return self.new + [n for names in self.reinitialised.values() for n in names]

    def _count(self, names) -> str:
        return f"{len(names)} tensors, {sum(self.numel[n] for n in names):,} parameters"

    def summary(self) -> str:
        mixer_layers = [i for i in range(self.n_layers) if i not in self.keep_softmax]
        lines = [
            f"XATL {self.kind}: {len(mixer_layers)} {self.kind} layers"
            + (f", softmax attention at {list(self.keep_softmax)}" if self.keep_softmax else ""),
            f"transfer: {', '.join(self.transfer) if self.transfer else 'nothing (scratch)'}",
            f"copied from the teacher: {self._count(self.copied_names)}",
        ]
        lines += [f"  {item:<10} {self._count(names)}" for item, names in self.copied.items() if names]
        lines.append(f"initialised fresh: {self._count(self.fresh)}")
        lines.append(f"  {'new':<10} {self._count(self.new)} (the {self.kind} mixers' own)")
        lines += [f"  {item:<10} {self._count(names)} (re-initialised)" for item, names in self.reinitialised.items() if names]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "transfer": list(self.transfer), "keep_softmax": list(self.keep_softmax),
                "copied": self.copied, "reinitialised": self.reinitialised, "new": self.new}


def transfer_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Module]]]:
    """The modules of an XATL student (or a softmax model) under each transfer item, plus ``new``
    (the mixers' own parameters, as ``(name, parameter)`` pairs). Every parameter falls in exactly one
    group; a layer part the map does not know is an error rather than a silent re-initialisation."""
    adapter = get_adapter(model.config)
    layers = adapter.layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    layer_path = names[id(layers)]
    groups: dict[str, list] = {item: [] for item in (*TRANSFERS, "new")}

    in_emb, out_emb = model.get_input_embeddings(), model.get_output_embeddings()
    groups["embeddings"].append((names[id(in_emb)], in_emb))
    if out_emb is not None and out_emb.weight is not in_emb.weight:
        groups["embeddings"].append((names[id(out_emb)], out_emb))
    for name, module in model.named_modules():  # the final norm: it feeds the output embeddings
        if name == layer_path or name.startswith(layer_path + ".") or module is in_emb or module is out_emb:
            continue
        if next(module.parameters(recurse=False), None) is not None:
            groups["embeddings"].append((name, module))

    for i, layer in enumerate(layers):
        prefix = f"{layer_path}.{i}"
        post_attention_is_attention = hasattr(layer, "pre_feedforward_layernorm")  # Gemma 2/3 sandwich norms
        for child_name, child in layer.named_children():
            if next(child.parameters(), None) is None:
                continue
            path = f"{prefix}.{child_name}"
            if child_name == adapter.attention_attr:
                if isinstance(child, FreshMixer):
                    for pname, p in child.named_parameters():
                        if child.keeps_output and pname.startswith(child.out_name + "."):
                            continue
                        item = "qkv" if pname.split(".")[0] in child.teacher_qkv else "new"
                        groups[item].append((f"{path}.{pname}", p))
                    if child.keeps_output:
                        groups["wo"].append((f"{path}.{child.out_name}", getattr(child, child.out_name)))
                else:
                    groups["attention"].append((path, child))
            elif child_name == "mlp" or child_name in _FFN_NORMS or (
                    child_name == "post_attention_layernorm" and not post_attention_is_attention):
                groups["ffn"].append((path, child))
            elif child_name in _ATTENTION_NORMS or child_name == "post_attention_layernorm":
                # before a new mixer the attention norm goes with W_O (for Mamba, which takes no W_O,
                # it is always fresh); before a kept softmax layer, with that layer
                item = "wo" if isinstance(adapter.attention(layer), FreshMixer) else "attention"
                groups[item].append((path, child))
            else:
                raise LinearizeError(f"layer {i} has a part {child_name!r} that the XATL transfer map does not know")
    return groups


def _parameter_names(model: nn.Module, groups) -> dict[str, list[str]]:
    """Parameter names (as ``model.named_parameters()`` gives them) per group; checks full coverage."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, list[str]] = {}
    seen: set[str] = set()
    for item, entries in groups.items():
        names = []
        for path, obj in entries:
            params = [obj] if isinstance(obj, nn.Parameter) else list(obj.parameters())
            for p in params:
                n = canonical[id(p)]
                if n not in seen:
                    seen.add(n)
                    names.append(n)
        out[item] = names
    missing = sorted(set(canonical.values()) - seen)
    if missing:
        raise LinearizeError(f"the XATL transfer map does not cover {missing[:3]}")
    return out


def _reinitialise(model: nn.Module, module: nn.Module) -> None:
    """Draw ``module``'s parameters afresh with the model family's own initialiser."""
    with torch.no_grad():
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                if getattr(p, "_is_hf_initialized", False):
                    p._is_hf_initialized = False
            model._init_weights(sub)


def build_xatl(teacher: nn.Module, arch: str = "retnet", transfer=None, keep_softmax=None, *,
               seed: int | None = None, hybrid_softmax_layers=None, **spec) -> tuple[nn.Module, XatlReport]:
    """A new ``arch`` model shaped like ``teacher``, its shared weights taken from it as ``transfer`` says.

    arch: a kind of role ``build`` (``retnet``, ``striped_mamba``) or an alias (``mamba``).
    transfer: items of ``TRANSFERS`` (a tuple or a comma string), ``()``/``"scratch"`` for none,
    None for the default. keep_softmax: None, ``"xatl"`` (layers 2 and N//2) or layer indices
    (``hybrid_softmax_layers`` is its earlier name). seed: makes every fresh tensor reproducible
    (the global RNG is left as it was). ``spec``: other spec keys (``chunk_size``, ``backend``,
    ``decay`` for retnet). The teacher is left untouched. Returns ``(student, report)``.
    """
    architectures = kinds.architectures()
    if arch not in architectures:
        raise LinearizeError(f"unknown XATL architecture {arch!r}; accepted: {', '.join(architectures)}")
    kind = architectures[arch]
    if hybrid_softmax_layers is not None:
        import warnings

        warnings.warn("build_xatl(hybrid_softmax_layers=...) is now keep_softmax=...", DeprecationWarning, stacklevel=2)
        keep_softmax = hybrid_softmax_layers if keep_softmax is None else keep_softmax
    for key in ("kind", "keep_softmax"):
        if key in spec:
            raise LinearizeError(f"build_xatl sets {key} itself (use arch and keep_softmax)")
    adapter = get_adapter(teacher.config)
    n_layers = len(adapter.layers(teacher))
    softmax_layers = resolve_keep_softmax(keep_softmax, n_layers)
    items = resolve_transfer(transfer, kind, softmax_layers)

    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        student = convert(teacher, {**spec, "kind": kind, "keep_softmax": list(softmax_layers)})
        groups = transfer_groups(student)
        for item in TRANSFERS:
            if item not in items and item not in MIXER_INIT:  # the mixers' own weights are fresh already
                for _, module in groups[item]:
                    _reinitialise(student, module)
        if "qkv" in items:
            teacher_layers = adapter.layers(teacher)
            for i, layer in enumerate(adapter.layers(student)):
                mixer = adapter.attention(layer)
                if isinstance(mixer, FreshMixer):
                    mixer.load_teacher_qkv(adapter.attention(teacher_layers[i]))

    names = _parameter_names(student, groups)
    report = XatlReport(
        kind=kind, transfer=items, keep_softmax=softmax_layers, n_layers=n_layers,
        copied={item: names[item] for item in TRANSFERS if item in items},
        reinitialised={item: names[item] for item in TRANSFERS
                       if item not in items and item not in MIXER_INIT and names[item]},
        new=names["new"] + [n for item in MIXER_INIT if item not in items for n in names[item]], numel={n: p.numel() for n, p in student.named_parameters()},
    )
    student.config.linearize = {**student.config.linearize, "xatl": {
        "arch": kind, "transfer": list(items), "keep_softmax": list(softmax_layers), "seed": seed}}
    return student, report


def xatl_record(model: nn.Module) -> dict | None:
    """The XATL choices a student was built with (``config.linearize["xatl"]``), or None."""
    info = getattr(model.config, "linearize", None) or {}
    return info.get("xatl")


def transferred_parameters(model: nn.Module, transfer=None) -> dict[str, nn.Parameter]:
    """The parameters that came from the teacher (the recorded transfer map, or ``transfer``), by name.

    Works on a freshly built student and on one rebuilt by ``linearize.load``: the grouping is
    recomputed from the structure. These are what the frozen / LIT modes freeze; the items that only
    initialise the new mixers (``MIXER_INIT``: ``qkv``) are left out, they train like the mixers.
    """
    if transfer is None:
        record = xatl_record(model)
        if record is None:
            raise LinearizeError("this model carries no XATL record: give the transfer items explicitly")
        transfer = record["transfer"]
    items = tuple(transfer)
    names = _parameter_names(model, transfer_groups(model))
    params = dict(model.named_parameters())
    return {n: params[n] for item in TRANSFERS if item in items and item not in MIXER_INIT for n in names[item]}


def set_requires_grad(parameters, flag: bool) -> int:
    """Set ``requires_grad`` on an iterable of parameters (or a name -> parameter dict); returns how many."""
    values = parameters.values() if isinstance(parameters, dict) else parameters
    count = 0
    for p in values:
        p.requires_grad_(flag)
        count += 1
    return count


__all__ = [
    "ARCHITECTURES", "DEFAULT_TRANSFER", "MIXER_INIT", "TRANSFERS", "XatlReport", "build_xatl", "default_transfer",
    "parse_keep_softmax", "resolve_keep_softmax", "resolve_transfer", "set_requires_grad", "takes_teacher_qkv", "transfer_groups",
    "transferred_parameters", "xatl_record", "xatl_softmax_layers",
]
