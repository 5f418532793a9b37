"""linearize: turn pretrained softmax-attention language models into linear-cost-inference models.

The API's names load on first use (``linearize.load``, ``from linearize import convert``;
``linearize.lazy``): the ``linearize`` command imports this package too, and its ``--help`` and
one-line errors must not wait for torch and transformers.
"""

from . import autoregister as _autoregister
from .errors import LinearizeError
from .lazy import lazy_names as _lazy_names
from .spec import Spec
from .version import __version__

_autoregister.install()  # AutoConfig / AutoModelForCausalLM learn the linearize_* types (linearize.hf)
_lazy_names(__name__, {
    "LinearizeCache": "cache", "RecurrentLayer": "cache", "load": "checkpoint", "save": "checkpoint",
    "convert": "convert", "mixers": "convert", "respec": "convert", "spec_of": "convert",
}, submodules=True)


def load_teacher(spec=None, dtype=None, device=None):
    """A softmax teacher and its tokenizer: a Hugging Face id, a local folder, a .gguf file, or
    nothing for the embedded SmolLM2-135M-Instruct. See ``linearize.teacher``."""
    from .teacher import load_teacher as _load_teacher

    return _load_teacher(spec, dtype=dtype, device=device)


def load_model(spec, dtype=None, device=None):
    """``(model, tokenizer)`` from a linearize checkpoint folder (``load``), or else from any teacher
    spec as ``load_teacher`` takes it ("default" for the embedded one)."""
    from pathlib import Path

    from .checkpoint import load

    path = Path(spec).expanduser()
    config = path / "config.json"
    if path.is_dir() and config.is_file() and '"linearize"' in config.read_text():
        model, tokenizer = load(path, dtype=dtype, device=device)
        model.linearize_source = str(path.resolve())
        return model, tokenizer
    return load_teacher(None if spec == "default" else spec, dtype=dtype, device=device)


__all__ = [
    "LinearizeCache", "LinearizeError", "RecurrentLayer", "Spec", "__version__", "convert", "load",
    "load_model", "load_teacher", "mixers", "respec", "save", "spec_of",
]
