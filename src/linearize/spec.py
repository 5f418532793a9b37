"""One small object describes a student: which mixer, its feature map, window, decay, kept layers.

It is saved in the checkpoint's config (``config.linearize``) and is all ``load`` needs to rebuild
the model. It can be given as a ``Spec``, a plain dict with the same keys as the CLI flags and YAML
recipes (``{"kind": "lolcats", "feature_map": "hedgehog", "window": 64}``), or a kind name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from . import kinds as _kinds
from .errors import LinearizeError

KINDS = _kinds.names()  # every registered mixer kind (linearize/kinds.py)
FEATURE_MAPS = ("hedgehog", "t2r", "elu", "relu")
DECAYS = ("none", "retnet", "lightning", "span", "learned", "gated")
FIXED_DECAYS = ("none", "retnet", "lightning")  # per query head: linear, supra, retnet
GATES = ("none", "span", "learned", "gated")  # the lolcats hybrid's linear state, per key head
NORMS = ("sum", "group", "separate")
LOLCATS_NORMS = ("sum", "separate")
BACKENDS = ("auto", "torch", "fla")
SPARSE_PRIORITIES = ("recall", "novelty", "first")  # ops.hybrid.PRIORITIES
SPARSE_ANCHORS = ("joint", "window")  # ops.hybrid.ANCHORS
WINDOW_DTYPES = ("auto", "float8")  # mixers/window.py: how the window-softmax layers keep keys and values


@dataclass(frozen=True)
class Spec:
    """A linear-cost student. ``None`` fields take the kind's default (see ``resolved``).

    kind: ``lolcats`` (sliding-window softmax + linear attention, LoLCATs eq. 7), ``linear``
        (normalised linear attention) or ``supra`` (shared ReLU-MLP kernel, RoPE after it, fixed
        decay, GroupNorm; SUPRA eq. 10), or an XATL architecture trained from the teacher's shared
        weights (``linearize.convert.xatl_transfer.build_xatl``): ``retnet`` (multi-scale retention,
        new q/k/v/gate, the teacher's W_O) or ``striped_mamba`` (a Mamba mixer in each block, the FFN kept); or
        ``delta``: the sliding window plus a gated delta-rule memory of older tokens (Gated
        DeltaNet; ``mixers/delta.py``), from the teacher's q/k/v/o (feature_map is not used).
    feature_map: ``hedgehog`` [softmax(xW) | softmax(-xW)], ``t2r`` ReLU(xW+b), ``elu`` elu+1, ``relu``.
        Applied after RoPE for lolcats/linear; supra always uses a square t2r shared by q and k.
    feature_dim: learned feature size per head (hedgehog outputs twice this).
    window: sliding-window size of the lolcats hybrid.
    decay: fixed per-head decay: ``retnet`` (1 - 2^(-5-h)), ``lightning`` (ALiBi slopes scaled by
        depth) or ``none``. supra and retnet default to retnet, the others to none. The lolcats
        hybrid's linear state takes instead, per key head, a fade that starts when a key leaves the
        window (``ops.hybrid``'s gates): ``span`` (fixed, horizons from ``window`` to
        ``decay_horizon`` tokens across the key heads), ``learned`` (the same start, one learned decay
        per key head) or ``gated`` (the same start, then data-dependent: ``g_t = exp(-softplus(x_t W +
        b))`` from the layer's input, GLA / Mamba-2 style, ``W`` zero at start).
    decay_horizon: lolcats with a decay: the longest starting horizon ``1 / (1 - g)`` in tokens
        (default: 16 x window); supra, linear, retnet: a cap on every head's fixed decay horizon (default:
        none), e.g. the training length, so that no head carries keys over distances training never
        showed it.
    feature_rope: lolcats and delta: the feature maps read the rotated q/k (LoLCATs; the default) or,
        off, the q/k before RoPE, so the linear terms (delta: the memory's keys and queries) do not depend
        on absolute positions (which past the training length the maps have never seen); the window's
        softmax keeps RoPE either way.
    norm: output normalisation: ``sum`` (divide by phi(q).sum phi(k)) or ``group`` (GroupNorm per
        head). supra and retnet default to group (``sum`` with decay none is the T2R baseline; retnet
        accepts only group), the others to sum. The lolcats hybrid takes ``sum`` (one normaliser shared
        by the window's and the linear terms, LoLCATs eq. 7) or ``separate`` (each normalised on its
        own, mixed by a learned weight per head starting at 0.5: the linear terms' weight no longer
        grows with their number).
    keep_softmax: indices of layers that keep their softmax attention (hybrids).
    softmax_window: with ``W`` > 0, each layer of ``keep_softmax`` that has no sliding window of its own keeps its
        softmax over its last ``W`` tokens only (``mixers/window.py``), so a student with kept layers still
        decodes in constant memory; 0 (the default) keeps them whole. No parameters. ``"W,I:W2,J:W3"``: layers I
        and J over W2 and W3 tokens instead (``softmax_windows``), e.g. short windows for the early layers and long
        ones for the layers that copy (induction heads).
    softmax_window_dtype: ``auto`` (the model's) or ``float8``: how the window-softmax layers keep their keys and
        values (``ops/window/float8.py``: e4m3 codes and a float32 scale per token and key head; the layers'
        sequence form attends over the same read-back values, so training, prefill and decoding agree).
    softmax_window_sinks: ``S`` > 0: the window-softmax layers also see each sequence's first ``S`` real tokens
        once those have left their window (attention sinks, ``ops/window/sinks.py``): ``S`` more slots of state.
    softmax_windows: the kept layers' own windows, ``(layer, W)`` pairs (from ``softmax_window``'s string form, or
        a ``{layer: W}`` mapping).
    keep_sliding: keep every teacher layer that has its own sliding window (Gemma 2/3's local layers,
        Mistral's) as it is, whatever the mixer's window: such a layer already decodes in constant memory,
        so only the global layers are converted. Off (the default), a sliding layer is kept only where a
        lolcats window covers it. The kept layers join ``keep_softmax`` in the recorded spec.
    sparse_cache: lolcats only: tokens per layer and key head kept exactly beside the window, chosen
        by ``sparse_priority`` (LoLA's rule is one; ``ops/hybrid/sparse_select.py``); 0 = off.
        Adds no parameters: a converted checkpoint takes one without training (``convert.respec``).
        Combines with ``feature_rope: false`` and any lolcats ``decay`` (a cached token fades only once
        folded, from when it left the window), not yet with ``norm: separate``.
    sparse_priority: which older tokens the sparse cache keeps: ``novelty`` (the default: the tokens whose
        values are least like any other candidate's: repeated text goes to the linear state, one-off tokens
        stay; it recalled best in every measurement, ``docs/reports/dial.md``, ``length.md``), ``recall``
        (LoLA's self-recall error, the tokens the linear state reads back worst) or ``first``
        (the sequence's first ``sparse_cache`` tokens, kept for good: StreamingLLM's attention sinks; with
        Hedgehog maps on CUDA a prefill or scoring pass runs the hybrid's forward kernels, and once they
        have left the window ``linearize.fast`` decodes through the fused CUDA step; not with a decay or
        ``feature_rope: false``, which take the PyTorch forms). Like
        ``sparse_cache`` it adds no parameters; it has no effect while ``sparse_cache`` is 0.
    sparse_anchor: how cached tokens weigh against the linear terms: ``window`` (the default: on the
        window's scale, as the hybrid was trained, so a cached token weighs what it would in the window) or
        ``joint`` (on the scale of the largest score over window and cache, LoLA's). No parameters either.
        A cache added to a model that had none (``respec``) starts from these defaults, whatever rules its
        spec recorded while they did nothing.
    sparse_linear: the linear terms' weight beside a sparse cache, in [0, 1]: 1 (the default) is the
        hybrid as trained; below 1 every ``phi(q) . phi(k)`` term (numerator and shared normaliser) is
        scaled by it, so cached tokens and the window weigh more against the folded rest; 0 leaves the
        window and the cache alone. For retrieval: on a trained ``lolcats_long`` student the linear terms
        of long repeated filler outweigh a cached pass key (``docs/reports/length.md``). No parameters; no
        effect while ``sparse_cache`` is 0.
    backend: ``auto`` (fla CUDA kernels when installed; lolcats: the hybrid's Triton kernels on
        CUDA, ``ops.use_hybrid_kernel``), ``torch`` or ``fla`` (the CUDA kernels required).
    """

    kind: str = field(default="lolcats", metadata={
        "cli": True, "choices": _kinds.names, "help": "the mixer: " + _kinds.help_text() + " (default: lolcats)"})
    feature_map: str | None = field(default=None, metadata={
        "cli": True, "choices": FEATURE_MAPS, "help": "learned feature map for lolcats/linear (default hedgehog; "
        "supra always uses its square shared t2r kernel)"})
    feature_dim: int = field(default=64, metadata={
        "cli": True, "help": "feature size per head; hedgehog outputs twice this (default 64)"})
    window: int = field(default=64, metadata={"cli": True, "help": "sliding-window size of the lolcats hybrid (default 64)"})
    decay: str | None = field(default=None, metadata={
        "cli": True, "choices": DECAYS, "help": "fixed per-head decay (default: retnet for supra, none otherwise)"})
    decay_horizon: int | None = None
    feature_rope: bool = True
    norm: str | None = field(default=None, metadata={
        "cli": True, "choices": NORMS, "help": "sum: divide by phi(q).sum phi(k); group: GroupNorm per head "
        "(default: group for supra, sum otherwise; supra with --norm sum --decay none is T2R)"})
    eps: float = 1e-6
    chunk_size: int = 64
    keep_softmax: tuple[int, ...] = field(default_factory=tuple)
    softmax_window: int = field(default=0, metadata={
        "cli": True, "help": "the layers kept softmax (--keep-softmax) attend over their last W tokens only, "
        "so the student decodes in constant memory (0: the whole sequence; the default); W,I:W2,...: layer I over W2"})
    softmax_windows: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    softmax_window_dtype: str = field(default="auto", metadata={
        "cli": True, "choices": WINDOW_DTYPES, "help": "how the window-softmax layers keep their keys and values: auto "
        "(the model's dtype; the default) or float8 (e4m3 with a scale per token and key head: about half the bytes "
        "of bf16; the layers attend over the same read-back values in training and decoding)"})
    softmax_window_sinks: int = field(default=0, metadata={
        "cli": True, "help": "the window-softmax layers also see each sequence's first S real tokens (attention "
        "sinks) once those have left their window: S more keys and values per key head (0: none; the default)"})
    keep_sliding: bool = False
    backend: str = field(default="auto", metadata={
        "cli": True, "choices": BACKENDS, "help": "auto: fla CUDA kernels when installed; torch: PyTorch only"})
    sparse_cache: int = field(default=0, metadata={
        "cli": True, "help": "lolcats: tokens per layer and key head kept exactly beside the window, by default those "
        "whose values are least like the others' (see --sparse-priority); 0 = off"})
    sparse_priority: str = field(default="novelty", metadata={
        "cli": True, "choices": SPARSE_PRIORITIES, "help": "lolcats with --sparse-cache: keep the tokens whose values "
        "are least like the other candidates' (novelty; the default), those the linear state recalls worst (recall, "
        "LoLA) or the sequence's first S tokens for good (first: attention sinks)"})
    sparse_anchor: str = field(default="window", metadata={
        "cli": True, "choices": SPARSE_ANCHORS, "help": "lolcats with --sparse-cache: which scores set the softmax "
        "terms' scale against the linear terms: window (the window's, as the hybrid was trained: a cached token "
        "weighs what it would in the window; the default) or joint (the largest over window and cache, LoLA's)"})
    sparse_linear: float = field(default=1.0, metadata={
        "cli": True, "help": "lolcats with --sparse-cache: the linear terms' weight beside the cache, in [0, 1] "
        "(1: as trained, the default; 0: the window and the cache alone)"})

    def __post_init__(self):
        _check_choice("kind", self.kind, _kinds.names())
        _check_choice("feature_map", self.feature_map, FEATURE_MAPS, optional=True)
        _check_choice("decay", self.decay, GATES if self.kind == "lolcats" else FIXED_DECAYS, optional=True)
        if self.decay_horizon is not None and (not isinstance(self.decay_horizon, int) or self.decay_horizon < 2):
            raise LinearizeError(f"spec decay_horizon must be an integer of at least 2 tokens, got {self.decay_horizon!r}")
        if not isinstance(self.keep_sliding, bool):
            raise LinearizeError(f"spec keep_sliding must be true or false, got {self.keep_sliding!r}")
        if not isinstance(self.feature_rope, bool):
            raise LinearizeError(f"spec feature_rope must be true or false, got {self.feature_rope!r}")
        if not self.feature_rope and self.kind not in ("lolcats", "delta"):
            raise LinearizeError(f"spec feature_rope applies to the lolcats and delta hybrids, not to kind {self.kind!r}")
        _check_choice("norm", self.norm, LOLCATS_NORMS if self.kind == "lolcats" else NORMS[:2], optional=True)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("softmax_window_dtype", self.softmax_window_dtype, WINDOW_DTYPES)
        _check_choice("sparse_priority", self.sparse_priority, SPARSE_PRIORITIES)
        _check_choice("sparse_anchor", self.sparse_anchor, SPARSE_ANCHORS)
        for name in ("feature_dim", "window", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LinearizeError(f"spec {name} must be a positive integer, got {value!r}")
        self._parse_softmax_windows()
        if self.softmax_window_dtype != "auto" and not (self.softmax_window or self.softmax_windows):
            raise LinearizeError(f"spec softmax_window_dtype {self.softmax_window_dtype} sets how the window-softmax "
                                 "layers keep their keys and values; give them a window (softmax_window W)")
        sinks = self.softmax_window_sinks
        if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
            raise LinearizeError(f"spec softmax_window_sinks must be a non-negative whole number of tokens, got {sinks!r}")
        if sinks and not (self.softmax_window or self.softmax_windows):
            raise LinearizeError(f"spec softmax_window_sinks {sinks} gives the window-softmax layers sinks; give them a "
                                 "window (softmax_window W)")
        cache = self.sparse_cache
        if not isinstance(cache, int) or isinstance(cache, bool) or cache < 0:
            raise LinearizeError(f"spec sparse_cache must be a non-negative integer, got {cache!r}")
        if cache and self.kind != "lolcats":
            raise LinearizeError(f"spec sparse_cache applies to the lolcats hybrid, not to kind {self.kind!r}")
        if cache and self.norm == "separate":
            raise LinearizeError("spec sparse_cache does not yet combine with norm separate")
        weight = self.sparse_linear
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
            raise LinearizeError(f"spec sparse_linear must be a number in [0, 1], got {weight!r}")
        object.__setattr__(self, "sparse_linear", float(weight))
        keep = self.keep_softmax
        if isinstance(keep, str):
            keep = [x for x in keep.replace(" ", "").split(",") if x]
        try:
            keep = tuple(sorted({int(i) for i in keep}))
        except (TypeError, ValueError):
            raise LinearizeError(f"spec keep_softmax must be layer indices like 0,15, got {self.keep_softmax!r}") from None
        object.__setattr__(self, "keep_softmax", keep)

    def _parse_softmax_windows(self) -> None:
        """``softmax_window`` as ``W`` or ``"W,I:W2,J:W3"`` (layer I over W2 tokens, ...): the default into
        ``softmax_window``, the layers' own into ``softmax_windows`` (JSON's string keys read back as layers)."""
        sw, own = self.softmax_window, self.softmax_windows or {}
        try:  # {layer: W} (JSON: string keys) or (layer, W) pairs
            own = dict(own.items() if isinstance(own, dict) else own)
        except (TypeError, ValueError):
            raise LinearizeError(f"spec softmax_windows must map layers to windows, got {own!r}") from None
        bad = LinearizeError(f"spec softmax_window must be W or W,I:W2,... (whole numbers of tokens; 0: kept layers "
                             f"see the whole sequence), got {sw!r}")
        if isinstance(sw, str):
            parts = [x for x in sw.replace(" ", "").split(",") if x]
            if not parts:
                raise bad
            default = parts[0] if ":" not in parts[0] else "0"
            try:
                for part in parts[1:] if ":" not in parts[0] else parts:
                    layer, _, width = part.partition(":")
                    own[int(layer)] = int(width)
                sw = int(default)
            except ValueError:
                raise bad from None
        if not isinstance(sw, int) or isinstance(sw, bool) or sw < 0:
            raise bad
        try:
            own = {int(k): v for k, v in own.items()}
        except (TypeError, ValueError):
            raise bad from None
        if any(i < 0 or isinstance(w, bool) or not isinstance(w, int) or w < 1 for i, w in own.items()):
            raise LinearizeError(f"spec softmax_windows: each layer's window must be a positive whole number of tokens "
                                 f"and each layer index non-negative, got {own!r}")
        object.__setattr__(self, "softmax_window", sw)
        object.__setattr__(self, "softmax_windows", tuple(sorted(own.items())))  # pairs: the spec stays hashable

    def window_for(self, layer: int) -> int:
        """The tokens a kept softmax layer ``layer`` sees (``softmax_windows``, else ``softmax_window``; 0: all)."""
        return dict(self.softmax_windows).get(layer, self.softmax_window)

    def resolved(self) -> "Spec":
        """The same spec with every kind-dependent default filled in."""
        supra = self.kind == "supra"
        retention = self.kind in ("supra", "retnet")
        return replace(
            self,
            feature_map=self.feature_map or ("t2r" if supra else "hedgehog"),
            decay=self.decay or ("retnet" if retention else "none"),
            norm=self.norm or ("group" if retention else "sum"),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self.resolved())
        d["keep_softmax"] = list(d["keep_softmax"])
        d["softmax_windows"] = {str(i): w for i, w in d["softmax_windows"]}
        return d

    @classmethod
    def coerce(cls, spec: "Spec | dict | str | None" = None, **overrides) -> "Spec":
        """Build a resolved Spec from a Spec, a dict, a kind name or nothing, plus keyword overrides."""
        if spec is None:
            base: dict[str, Any] = {}
        elif isinstance(spec, Spec):
            base = {f.name: getattr(spec, f.name) for f in fields(cls)}
        elif isinstance(spec, str):
            base = {"kind": spec}
        elif isinstance(spec, dict):
            base = dict(spec)
        else:
            raise LinearizeError(f"a spec must be a Spec, a dict or a kind name, got {type(spec).__name__}")
        base.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(base) - known)
        if unknown:
            raise LinearizeError(f"unknown spec key(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}")
        return cls(**base).resolved()


def _check_choice(name: str, value, choices, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in choices:
        raise LinearizeError(f"spec {name} must be one of {', '.join(choices)}, got {value!r}")
