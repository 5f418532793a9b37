"""Linearized checkpoints as Hugging Face model types: ``AutoModelForCausalLM``, ``AutoConfig``,
``pipeline("text-generation", ...)``, ``trust_remote_code=True`` and ``lm_eval --model hf``.

A student is its teacher's architecture with attention layers replaced. Saved with the teacher's
``model_type`` it would load in plain transformers *as the teacher*: the mixers' tensors dropped as
unexpected keys, softmax attention over the adopted projections, no error. So a student declares
its own type.

**One model type per base family, ``linearize_<base>``** (``linearize_llama``, ``linearize_qwen3``,
``linearize_gemma3_text``, ``linearize_gpt_neox``, ...: every adapter's model type, prefixed). Its
config class subclasses the base family's config: the base fields stay flat in config.json (tools
that read ``hidden_size`` or ``num_hidden_layers`` keep working) and the ``linearize`` record sits
beside them (spec, teacher, conversion date, training runs, the weights' sha256). Its model class
subclasses the base family's ``...ForCausalLM`` and, when built, converts its layers as the recorded
spec says (``convert.layers.apply_spec``); its ``generate()`` takes the fast decoder by default
(``decode.route``). Parameters and state-dict keys are exactly the student's, so
``from_pretrained`` loads every tensor by name, XATL students (whose mixers drop q/k/v) included.
One ``linearize`` type with the base config nested was the alternative; transformers maps a config
class to one model class, so it would need a wrapper module whose paths and state-dict keys
(``model.model.layers...``) differ from the base model's, which the adapters, LoRA targets, the fast
decoder and every checkpoint written so far rely on. A new adapter family gets its pair of classes
from the same code (``config_class`` / ``model_class``).

Three ways a checkpoint loads:

- ``import linearize`` registers every ``linearize_*`` config with ``AutoConfig`` and model with
  ``AutoModelForCausalLM`` (``linearize.autoregister`` does it as soon as transformers' Auto
  classes are imported, so that ``import linearize`` alone stays light);
- ``trust_remote_code=True`` without that import: ``save_pretrained`` writes ``auto_map`` and a small
  ``modeling_linearize.py`` that takes the classes from the installed package, or raises an
  ImportError that says ``pip install linearize``;
- neither: transformers refuses the checkpoint (it does not know the model type and does not run a
  checkpoint's code unasked).

Checkpoints written before this (``model_type`` the base family's plus a ``linearize`` entry) load
through ``linearize.load``, which builds them with these classes; saving such a model writes the
new form. ``from_pretrained`` here also checks the weights' sha256 recorded at save time, refuses a
checkpoint that lacks or has extra tensors (transformers would initialise missing ones randomly),
and recomputes the mixers' unsaved constant buffers after transformers' meta-device construction.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from .version import __version__
from .errors import LinearizeError
from .models import LINEARIZED_PREFIX, SUPPORTED_MODEL_TYPES, base_model_type
from .spec import Spec

MODELING_FILE = "modeling_linearize.py"
AUTO_CLASSES = ("AutoConfig", "AutoModelForCausalLM")
PREFIX = LINEARIZED_PREFIX


def model_type_of(base: str) -> str:
    """``llama`` -> ``linearize_llama``."""
    return PREFIX + base


def _check_base(base: str) -> str:
    if base not in SUPPORTED_MODEL_TYPES:
        raise LinearizeError(f"unsupported architecture '{base}': linearize supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    return base


# --- the linearize record in a config -------------------------------------------------------------

SAVED_BEFORE_RULES = {"sparse_priority": "recall", "sparse_anchor": "joint"}


def checked_record(record, where: str = "the config") -> dict:
    """The ``linearize`` entry of a config, checked: a mapping whose ``spec`` is a valid spec."""
    if not isinstance(record, dict):
        raise LinearizeError(f"{where}: its linearize entry must be a mapping with a spec, got {type(record).__name__}")
    if "spec" not in record:
        raise LinearizeError(f"{where}: its linearize entry has no spec (the mixer kind, feature map, window ... the "
                             "student was converted with), so the model cannot be rebuilt; restore it from the run that "
                             "wrote the checkpoint or convert the teacher again")
    Spec.coerce(record["spec"])  # a LinearizeError names a bad key or value
    if isinstance(record["spec"], dict):  # saved before the sparse cache's rules were keys: LoLA's, the only ones then
        for key, value in SAVED_BEFORE_RULES.items():
            record["spec"].setdefault(key, value)
    return record


def auto_map(base: str) -> dict[str, str]:
    """The config's ``auto_map``: what ``trust_remote_code=True`` imports from ``modeling_linearize.py``."""
    stem = MODELING_FILE.removesuffix(".py")
    return {"AutoConfig": f"{stem}.{config_class(base).__name__}",
            "AutoModelForCausalLM": f"{stem}.{_model_class_name(base)}"}


# --- the classes ----------------------------------------------------------------------------------

def _base_config_class(base: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[_check_base(base)]


def _base_model_class(base: str):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[_base_config_class(base)]


def _model_class_name(base: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return "Linearize" + MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[_check_base(base)]


@functools.cache
def config_class(base: str) -> type:
    """The ``linearize_<base>`` config class: the base family's config with its own model type."""
    parent = _base_config_class(base)
    name = "Linearize" + parent.__name__
    return type(name, (parent,), {
        "model_type": model_type_of(base), "base_model_type": base, "__module__": __name__, "__qualname__": name,
        "__doc__": f"A linearize student of the {base} family: ``{parent.__name__}``'s fields plus the ``linearize`` "
                   "record (spec, teacher, training, weights' sha256). See ``linearize.hf``."})


class LinearizedModel:
    """What every ``linearize_<base>`` model class adds to its base family's ``...ForCausalLM``."""

    base_model_class: type  # the family's ForCausalLM this class extends

    def __init__(self, config, *args, **kwargs):
        record = checked_record(getattr(config, "linearize", None), f"{type(self).__name__} config")
        super().__init__(config, *args, **kwargs)
        from .convert.layers import apply_spec

        apply_spec(self, Spec.coerce(record["spec"]))
        config.auto_map = auto_map(config.base_model_type)

    def generate(self, *args, fast_decoding: bool | None = None, **kwargs):
        """transformers' ``generate()``, decoded by linearize's fast decoder wherever it honours the call
        (greedy or sampling with temperature / top-k / top-p, EOS ids, stopping criteria, streamers), else
        by transformers' own loop with one warning line saying why (``linearize.decode.route``).
        ``fast_decoding=False``, or ``generation_config.fast_decoding = False``, always takes
        transformers' loop; None (the default) takes the generation config's setting, else the fast one."""
        from .decode.route import generate

        return generate(self, super().generate, fast_decoding, *args, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """A no-op: transformers calls this when it loads the class through ``trust_remote_code`` and
        would then copy this package's module into saved checkpoints; ``save_pretrained`` writes the
        checkpoint's own ``modeling_linearize.py`` instead."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained``, plus: the weights' sha256 checked first (a local folder),
        the mixers' constant buffers recomputed, and missing, unexpected or mis-shaped tensors an error."""
        want_info = kwargs.pop("output_loading_info", False)
        folder = Path(str(pretrained_model_name_or_path))
        if folder.is_dir():
            check_weights(folder)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        from .convert.layers import mixers

        for mixer in mixers(model).values():
            mixer.reset_fixed_buffers()
        for key, what in (("missing_keys", "lacks"), ("unexpected_keys", "holds tensors its spec does not use:"),
                          ("mismatched_keys", "holds tensors of the wrong shape:")):
            bad = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(key, ()) or ())
            if bad:
                raise LinearizeError(f"checkpoint {pretrained_model_name_or_path} {what} {bad[:3]}"
                                     f"{' ...' if len(bad) > 3 else ''}: it does not match its spec (incomplete or corrupt)")
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, is_main_process: bool = True, *args, push_to_hub: bool = False, **kwargs):
        """transformers' ``save_pretrained``, plus ``auto_map``, ``modeling_linearize.py`` (for
        ``trust_remote_code=True``) and the sha256 of every weights file in the ``linearize`` record.
        ``push_to_hub=True`` saves locally first, then uploads through ``push_to_hub``."""
        base = self.config.base_model_type
        self.config.auto_map = auto_map(base)
        hub = {k: kwargs.pop(k) for k in ("repo_id", "commit_message", "create_pr", "private", "token") if k in kwargs}
        super().save_pretrained(save_directory, is_main_process, *args, **kwargs)
        if not is_main_process:
            return
        folder = Path(save_directory)
        (folder / MODELING_FILE).write_text(modeling_source(base))
        digests = weights_sha256(folder)
        self.config.linearize = {**self.config.linearize, "weights_sha256": digests}
        config_path = folder / "config.json"
        saved = json.loads(config_path.read_text())
        saved["linearize"] = {**saved["linearize"], "weights_sha256": digests}
        config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        if push_to_hub:
            self.push_to_hub(hub.pop("repo_id", folder.name), **hub)


@functools.cache
def model_class(base: str) -> type:
    """The ``linearize_<base>`` model class: the base family's ForCausalLM, converted when built."""
    parent = _base_model_class(base)
    name = _model_class_name(base)
    return type(name, (LinearizedModel, parent), {
        "config_class": config_class(base), "base_model_class": parent, "__module__": __name__, "__qualname__": name,
        "__doc__": f"A linearize student of the {base} family: ``{parent.__name__}`` whose attention layers are the "
                   "mixers its config's ``linearize`` spec names. See ``linearize.hf``."})


def __getattr__(name: str):
    """``linearize.hf.LinearizeLlamaForCausalLM`` and the like, built on first use."""
    if not name.startswith("Linearize"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for base in filter(_available, SUPPORTED_MODEL_TYPES):
        if name == "Linearize" + _base_config_class(base).__name__:
            return config_class(base)
        if name == _model_class_name(base):
            return model_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def as_linearized(model):
    """Make a freshly converted student (an instance of its family's ForCausalLM) an instance of its
    ``linearize_<base>`` class, its config of the matching config class; returns it. Other classes
    (a model built from another head, say) keep theirs: ``linearize.load`` still rebuilds them."""
    base = base_model_type(model.config.model_type)
    if model.config.model_type == model_type_of(base):
        return model
    target = model_class(base)
    if type(model) is target.base_model_class and type(model.config) is _base_config_class(base):
        model.__class__ = target
        model.config.__class__ = config_class(base)
        model.config.auto_map = auto_map(base)
    return model


def config_from_dict(values: dict):
    """A ``linearize_<base>`` config from a config.json's contents, new form or old (the base model
    type plus a ``linearize`` entry)."""
    base = _check_base(base_model_type(values.get("model_type")))
    cls = config_class(base)
    return cls.from_dict({**values, "model_type": cls.model_type})


# --- registration ---------------------------------------------------------------------------------

def _available(base: str) -> bool:
    """Whether this transformers has the family (an older one may lack e.g. ``smollm3``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return base in CONFIG_MAPPING_NAMES


def register_configs() -> None:
    """``AutoConfig`` learns every ``linearize_<base>`` type."""
    from transformers import AutoConfig

    for base in filter(_available, SUPPORTED_MODEL_TYPES):
        AutoConfig.register(model_type_of(base), config_class(base), exist_ok=True)


def register_models() -> None:
    """``AutoModelForCausalLM`` learns every ``linearize_<base>`` model class (this imports each
    family's modeling file). The type is also added to ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
    where ``pipeline("text-generation")`` and lm-eval look a model type up (they would otherwise log
    that the model is not a causal LM)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for base in filter(_available, SUPPORTED_MODEL_TYPES):
        AutoModelForCausalLM.register(config_class(base), model_class(base), exist_ok=True)
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(model_type_of(base), _model_class_name(base))


def register() -> None:
    """Both registrations (``linearize.autoregister`` calls each when transformers is ready)."""
    register_configs()
    register_models()


# --- files beside the weights ---------------------------------------------------------------------

def modeling_source(base: str) -> str:
    """``modeling_linearize.py`` of a checkpoint: it names the classes ``auto_map`` points to and takes
    them from the installed package (imports inside ``try`` are not ones transformers insists on)."""
    config_name, model_name = config_class(base).__name__, _model_class_name(base)
    return f'''"""A linearize checkpoint: a {base} model whose attention layers are linear-cost mixers.

Loaded with ``trust_remote_code=True``, transformers runs this file, which takes the model classes from
the installed linearize package. ``import linearize`` before ``from_pretrained`` does the same without
trust_remote_code.
"""

try:
    from linearize.hf import config_class as _config_class, model_class as _model_class
except ImportError as _error:
    raise ImportError(
        "this checkpoint is a linearize model ({model_type_of(base)}: a {base} model whose attention layers are "
        "linear-cost mixers, written by linearize {__version__}); loading it needs the linearize package: "
        "pip install linearize"
    ) from _error

{config_name} = _config_class("{base}")
{model_name} = _model_class("{base}")
'''


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (the shards its index names, or the single file)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    return [single] if single.exists() else []


def weights_sha256(folder: Path) -> dict[str, str]:
    """sha256 of each weights file, by file name."""
    out = {}
    for path in weight_files(folder):
        with open(path, "rb") as handle:
            out[path.name] = hashlib.file_digest(handle, "sha256").hexdigest()
    return out


def check_weights(folder: Path, record: dict | None = None) -> None:
    """LinearizeError unless every weights file matches the sha256 recorded when it was saved
    (checkpoints without a recorded hash pass)."""
    if record is None:
        try:
            record = json.loads((folder / "config.json").read_text()).get("linearize")
        except (OSError, ValueError):
            return  # an unreadable config fails with its own error
    recorded = record.get("weights_sha256") if isinstance(record, dict) else None
    if not recorded:
        return
    for name, digest in sorted(recorded.items()):
        path = folder / name
        if not path.is_file():
            raise LinearizeError(f"checkpoint {folder} lacks {name}, a weights file its config.json records")
        with open(path, "rb") as handle:
            actual = hashlib.file_digest(handle, "sha256").hexdigest()
        if actual != digest:
            raise LinearizeError(
                f"checkpoint {folder}: {name} does not match the sha256 recorded in config.json when it was saved "
                f"(recorded {digest[:12]}..., found {actual[:12]}...): the weights were changed or damaged since; save "
                "the model again, or drop weights_sha256 from config.json's linearize entry to load them anyway")
