"""Packages whose names load on first use.

``linearize``, ``linearize.data`` and ``linearize.eval`` export names from modules that import torch
and transformers (about 2 s of CPU), and the ``linearize`` command imports these packages to build its
parser: ``--help`` and the one-line errors must not wait for them. ``lazy_names`` makes a package
import such a name's module when the name is first read (``linearize.load``, ``from linearize.eval
import perplexity``) and keep it.

Where a name is also one of the package's submodules (the function ``linearize.convert`` and the
package ``linearize/convert/``; ``linearize.mixers``; ``linearize.eval.perplexity``), the name stays
the function: Python sets a submodule, once imported, as an attribute of its package, and the package
drops exactly that assignment.
"""

from __future__ import annotations

import importlib
import sys
import types


class LazyPackage(types.ModuleType):
    """A package module with ``_lazy_names`` (name -> the submodule defining it, relative)."""

    _lazy_names: dict[str, str] = {}
    _submodules: bool = False

    def __getattr__(self, name: str):
        lazy = self.__dict__.get("_lazy_names", {})
        if name in lazy:
            value = getattr(importlib.import_module(f"{self.__name__}.{lazy[name]}"), name)
            self.__dict__[name] = value
            return value
        if self.__dict__.get("_submodules") and not name.startswith("_"):
            try:  # ``import linearize; linearize.ops``: as it was when the package imported everything
                return importlib.import_module(f"{self.__name__}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{self.__name__}.{name}":
                    raise
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self.__dict__.get("_lazy_names", {})))

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and name in self.__dict__.get("_lazy_names", {}) \
                and value.__name__ == f"{self.__name__}.{name}":
            return  # the submodule of a lazy name's name: the name keeps its value (see the module docstring)
        super().__setattr__(name, value)


def lazy_names(package: str, names: dict[str, str], submodules: bool = False) -> None:
    """Make ``package`` (its ``__name__``) load each of ``names`` (name -> submodule defining it) on
    first use; ``submodules``: an unknown name that is a submodule is imported too."""
    module = sys.modules[package]
    module.__class__ = LazyPackage
    module.__dict__["_lazy_names"] = dict(names)
    module.__dict__["_submodules"] = submodules
