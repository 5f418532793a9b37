"""Imported by the Triton interpreter scripts: Triton 3.6's interpreter converts 1-element arrays
with int(), which NumPy >= 2.4 refuses; convert their single element instead."""

import triton.runtime.interpreter as interpreter

_patch = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor
