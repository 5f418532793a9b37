"""``import linearize`` registers the ``linearize_*`` model types with transformers' Auto classes.

Building the classes (``linearize.hf``) imports transformers' config and modeling machinery and
every supported family's modeling file: about 2 s of CPU that ``import linearize``, and so every
``linearize`` command (``--help`` and one-line errors included), would otherwise pay. So the
registration waits until transformers' Auto modules are imported, which any use of
``AutoConfig`` / ``AutoModelForCausalLM`` / ``pipeline`` / lm-eval does first:

- if they are imported already, ``install`` registers at once;
- otherwise a finder on ``sys.meta_path`` watches the imports of ``transformers`` modules and, once
  the outermost one in progress has finished executing, registers the configs (when
  ``configuration_auto`` is loaded) and the models (when ``modeling_auto`` is). Not earlier: the
  families' modeling files import the Auto package themselves (through ``transformers.modeling_layers``),
  and building the classes in the middle of that chain would import a half-initialised module.

The finder only wraps ``exec_module`` of the loader that the other finders return for a
``transformers.*`` module (that module's own loader object); it removes itself once both parts are
registered.
"""

from __future__ import annotations

import sys
import threading

CONFIGS = "transformers.models.auto.configuration_auto"
MODELS = "transformers.models.auto.modeling_auto"

_local = threading.local()  # depth: transformers modules executing on this thread; busy: registering
_done: set[str] = set()


def _watched(name: str) -> bool:
    return name == "transformers" or name.startswith("transformers.")


def register_ready() -> None:
    """Register whatever transformers has loaded the Auto modules for, once each."""
    if getattr(_local, "busy", False) or len(_done) == 2:
        return
    _local.busy = True
    try:
        from . import hf

        for part, module, register in (("configs", CONFIGS, hf.register_configs), ("models", MODELS, hf.register_models)):
            if part in _done or module not in sys.modules:
                continue
            _done.add(part)
            try:
                register()
            except Exception as exc:  # never break the import that triggered it
                import warnings

                warnings.warn(f"linearize could not register its model types with transformers' Auto classes "
                              f"({type(exc).__name__}: {exc}); linearize.load still reads its checkpoints", stacklevel=2)
    finally:
        _local.busy = False
    if len(_done) == 2:
        _remove_finder()


class _Finder:
    """Finds nothing itself: gives a ``transformers.*`` module the spec the other finders give,
    with its loader's ``exec_module`` wrapped to register after the outermost import ends."""

    def find_spec(self, name, path=None, target=None):
        if not _watched(name) or getattr(_local, "finding", False):
            return None
        _local.finding = True
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    break
        finally:
            _local.finding = False
        loader = getattr(spec, "loader", None)
        execute = getattr(loader, "exec_module", None)
        if execute is None:
            return spec

        def exec_module(module):
            depth = getattr(_local, "depth", 0)
            _local.depth = depth + 1
            try:
                execute(module)
            finally:
                _local.depth = depth
            if depth == 0:
                register_ready()

        try:
            loader.exec_module = exec_module  # this module's loader object only
        except (AttributeError, TypeError):
            pass
        return spec


_finder = _Finder()


def _remove_finder() -> None:
    try:
        sys.meta_path.remove(_finder)
    except ValueError:
        pass


def install() -> None:
    """Register now where transformers is ready, and watch its imports for the rest."""
    if CONFIGS in sys.modules or MODELS in sys.modules:
        register_ready()
    if len(_done) < 2 and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
