"""linearize: turn pretrained softmax-attention language models into linear-cost-inference models."""

__version__ = "0.1.0"

from .cache import LinearizeCache, RecurrentLayer  # noqa: E402
from .checkpoint import load, save  # noqa: E402
from .convert import convert, mixers, spec_of  # noqa: E402
from .errors import LinearizeError  # noqa: E402
from .spec import Spec  # noqa: E402
from . import autoregister as _autoregister  # noqa: E402

_autoregister.install()  # AutoConfig / AutoModelForCausalLM learn the linearize_* types (linearize.hf)


def load_teacher(spec=None, dtype=None, device=None):
    """A softmax teacher and its tokenizer: a Hugging Face id, a local folder, a .gguf file, or
    nothing for the embedded SmolLM2-135M-Instruct. See ``linearize.teacher``."""
    from .teacher import load_teacher as _load_teacher

    return _load_teacher(spec, dtype=dtype, device=device)


__all__ = [
    "LinearizeCache", "LinearizeError", "RecurrentLayer", "Spec", "__version__", "convert", "load",
    "load_teacher", "mixers", "save", "spec_of",
]
