"""Named shapes: teachers with a real model's architecture and random weights, for speed and memory only.

``load_teacher("shape:llama-3-8b")`` (``--teacher shape:llama-3-8b`` wherever a command takes a teacher)
builds a model of Llama 3 8B's architecture with random weights, directly on the requested device and in
the requested dtype. Time per step, tokens/s and peak memory do not depend on the weights nor on which
token ids a batch holds, so a shape measures a teacher and its students at a real size without the real
weights; what it says about quality means nothing, so quality rows stay on real teachers.

Each shape is a YAML file in this folder: ``name``, ``source`` (the Hugging Face repository whose public
``config.json`` it copies), ``aliases``, ``parameters`` (the count its config builds; the tests check it
on the meta device) and ``config`` (the architecture's keys, as ``config.json`` names them; token ids are
left out: they follow the tokenizer paired with the shape, ``linearize.teacher``).

Spelling: ``shape:NAME`` or ``shape:NAME,layers=N``, which keeps the first N layers only: time and
memory per layer of a model too large to build whole (``shape:llama-3-70b,layers=4``). A comma rather
than ``?layers=N``: zsh refuses an unquoted ``?`` that matches no file.

For the tests, ``shrunk_for_tests`` builds every shape narrower (same structure) inside a ``with``.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LinearizeError

HERE = Path(__file__).parent
PREFIX = "shape:"
OPTIONS = ("layers",)  # what may follow the name: shape:NAME,layers=N


@dataclass(frozen=True)
class Shape:
    """One named shape: a real model's architecture (``config``) and where it was copied from."""

    name: str  # what follows "shape:"
    source: str  # the Hugging Face repository whose config.json the config copies
    parameters: int  # what the config builds, whole (checked by the tests on the meta device)
    config: dict = field(repr=False)  # the architecture's keys, model_type among them
    aliases: tuple[str, ...] = ()


@functools.cache
def named_shapes() -> dict[str, Shape]:
    """Every shape shipped in this folder, by name, smallest first (read once)."""
    import yaml

    shapes = []
    for path in HERE.glob("*.yaml"):
        entry = yaml.safe_load(path.read_text())
        shapes.append(Shape(name=entry["name"], source=entry["source"], parameters=int(entry["parameters"]),
                            config=dict(entry["config"]), aliases=tuple(entry.get("aliases") or ())))
    return {s.name: s for s in sorted(shapes, key=lambda s: s.parameters)}


def _by_alias() -> dict[str, Shape]:
    return {alias.lower(): s for s in named_shapes().values() for alias in (s.name, *s.aliases)}


def is_shape(spec) -> bool:
    """Whether ``spec`` (a teacher spec) asks for a named shape: a string beginning with ``shape:``."""
    return isinstance(spec, str) and spec.strip().lower().startswith(PREFIX)


def known() -> str:
    """The shapes' names, for error lines and help texts."""
    return ", ".join(named_shapes())


def parse(spec: str) -> tuple[Shape, int | None]:
    """``(shape, layers)`` of ``shape:NAME[,layers=N]`` (names case-insensitive, aliases too); ``layers``
    is None for the whole model. One ``LinearizeError`` line for an unknown name or a bad option."""
    text = spec.strip()[len(PREFIX):]
    name, *options = (part.strip() for part in text.split(","))
    shape = _by_alias().get(name.lower())
    if shape is None:
        raise LinearizeError(f"unknown shape '{name}' in teacher '{spec.strip()}'; the named shapes are {known()} "
                             "(shape:NAME[,layers=N]: that architecture with random weights, for speed and "
                             "memory only)")
    layers = None
    total = int(shape.config["num_hidden_layers"])
    for option in options:
        key, sep, value = option.partition("=")
        if key.strip().lower() not in OPTIONS or not sep:
            raise LinearizeError(f"teacher '{spec.strip()}': unknown shape option '{option}'; the one option is "
                                 f"layers=N (shape:{shape.name},layers=4 keeps the first 4 of its {total} layers)")
        try:
            layers = int(value)
        except ValueError:
            layers = 0
        if not 1 <= layers <= total:
            raise LinearizeError(f"teacher '{spec.strip()}': layers must be a whole number from 1 to {total} "
                                 f"(the layers of {shape.name}), got '{value.strip()}'")
    return shape, None if layers == total else layers


def canonical(shape: Shape, layers: int | None = None) -> str:
    """The spec that names ``shape`` (with ``layers``), as models built from it record their source."""
    return f"{PREFIX}{shape.name}" + (f",layers={layers}" if layers else "")


def shape_config(shape: Shape | str, layers: int | None = None):
    """The transformers config of ``shape`` (a ``Shape`` or a spec ``shape:NAME[,layers=N]``), with its
    first ``layers`` layers only when given (a per-layer list such as ``layer_types`` is cut to match);
    narrower inside ``shrunk_for_tests``."""
    from transformers import AutoConfig

    if isinstance(shape, str):
        shape, parsed = parse(shape if is_shape(shape) else PREFIX + shape)
        layers = layers or parsed
    values = dict(shape.config)
    if layers:
        values["num_hidden_layers"] = layers
        if isinstance(values.get("layer_types"), list):
            values["layer_types"] = values["layer_types"][:layers]
    if _SHRINK is not None:
        values = _shrunk(values, **_SHRINK)
    return AutoConfig.for_model(values.pop("model_type"), **values)


# A CPU build past this many parameters is filled from a seeded pool (``_fill_from_pool``) instead of by
# transformers' initialisation, which draws every value one at a time on one core: the 8B shape took minutes
# per process before any GPU work (FSDP builds its teacher on the CPU in every process).
POOL_FILL_PARAMETERS = 300_000_000
POOL_SIZE = (1 << 22) + 1  # odd: a row of any power-of-two width starts at a new place in the pool


def random_model(config, dtype, device, seed: int = 0):
    """A causal LM of ``config`` with random weights (transformers' own initialisation, seeded by
    ``seed``; the caller's random state is left as it was), in eval mode. Built under ``device`` and
    ``dtype`` (a ``torch.device`` / ``torch.dtype``): every tensor is made where it stays, in the dtype
    it keeps, so a GPU build never holds an fp32 copy on the CPU first; ``device="meta"`` allocates
    nothing (shapes and parameter counts only). On the CPU, a model of more than ``POOL_FILL_PARAMETERS``
    is built uninitialised and filled by ``_fill_from_pool`` (seconds, not minutes, at 8B)."""
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    cuda = device.type == "cuda"
    if device.type == "cpu" and _count(config) > POOL_FILL_PARAMETERS:
        from transformers.initialization import no_init_weights

        with device, no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        _fill_from_pool(model, float(getattr(config, "initializer_range", None) or 0.02), seed)
        return model.eval()
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []), device:
        torch.random.default_generator.manual_seed(seed)
        if cuda:  # that device's generator alone: the other GPUs (other processes' under torchrun) stay untouched
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _count(config) -> int:
    """Parameters ``config`` builds (on the meta device: nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _fill_from_pool(model, std: float, seed: int) -> None:
    """Every linear and embedding weight of ``model`` (built without initialisation) as
    ``N(0, std)`` values: windows of one seeded pool of ``POOL_SIZE`` normal draws, each weight from its
    own seeded offset, the pool repeated along it (memory copies, not one draw per value). Linear biases
    zero and an embedding's padding row zero, as transformers initialises them; other parameters (norm
    weights, made in their constructors) and buffers as built. Deterministic in ``seed``; speed and memory,
    all a shape is for, do not depend on the values."""
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(POOL_SIZE, generator=gen).mul_(std)
    cast, filled = {}, set()
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                continue
            w = module.weight
            if w.data_ptr() in filled:  # tied to one already filled
                continue
            src = cast.setdefault(w.dtype, pool.to(w.dtype))
            n, start = w.numel(), int(torch.randint(POOL_SIZE, (1,), generator=gen))
            flat, done = w.view(-1), 0
            while done < n:
                take = min(n - done, POOL_SIZE - start)
                flat[done:done + take].copy_(src[start:start + take])
                done, start = done + take, 0
            filled.add(w.data_ptr())
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                w[module.padding_idx].zero_()


# --- a tokenizer whose ids fit any vocabulary -------------------------------------------------------

BYTE_EOS = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (byte-level BPE's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A byte-level tokenizer: token id ``b`` is the byte ``b`` of the UTF-8 text (0-255), and 256 is
    ``<|endoftext|>`` (eos and pad; no bos). Any text round-trips, and every id is below 257, so it fits
    any shape's vocabulary: the tokenizer of shapes the embedded teacher's does not fit (or without it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=BYTE_EOS, pad_token=BYTE_EOS,
                                        clean_up_tokenization_spaces=False, model_max_length=1 << 30)
    tokenizer.name_or_path = "linearize-bytes"
    return tokenizer


# --- test-only: narrower shapes of the same structure ----------------------------------------------

_SHRINK: dict | None = None


@contextmanager
def shrunk_for_tests(head_dim: int = 8, vocab_size: int = 512):
    """Test-only: inside the ``with``, every shape's config (``shape_config``, so ``load_teacher`` and the
    commands too) is built narrower with the same structure, small enough for CPU tests of the real code
    paths. Kept: the model type, the layer count (and ``layers=N``), the query and key/value head counts
    (the GQA ratio), tied embeddings, RoPE, biases. Changed: ``head_dim`` (so the hidden size is heads x
    ``head_dim``), the MLP width (scaled with the hidden size) and the vocabulary (``vocab_size``)."""
    global _SHRINK
    before, _SHRINK = _SHRINK, {"head_dim": head_dim, "vocab_size": vocab_size}
    try:
        yield
    finally:
        _SHRINK = before


def _shrunk(values: dict, head_dim: int, vocab_size: int) -> dict:
    """``values`` (a shape's config keys) narrowed as ``shrunk_for_tests`` says."""
    heads = int(values["num_attention_heads"])
    hidden = heads * head_dim
    scale = hidden / int(values["hidden_size"])
    return {**values, "head_dim": head_dim, "hidden_size": hidden, "vocab_size": vocab_size,
            "intermediate_size": max(8, round(int(values["intermediate_size"]) * scale))}
