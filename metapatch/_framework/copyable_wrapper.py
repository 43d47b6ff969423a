"""The wrapt function wrapper a patch's ``wrapper`` is installed as, made copyable as the function it wraps is.

wrapt's proxies refuse ``copy.copy`` and ``copy.deepcopy`` ("object proxy must define __deepcopy__()"). A bound
wrapper ends up inside objects: accelerate keeps a hooked module's own ``forward`` as ``module._old_forward``, so a
deep copy of a dispatched model (a reference model for DPO/PPO, a frozen teacher) whose hooked modules have a
wrapped ``forward`` (``Linear4bit.forward``, ``Gemma4Model.forward``) raised there, while upstream's bound method
copies. Here a deep copy of a bound wrapper is the wrapper bound to the copy of its instance, as a deep copy of a
bound method is; a function wrapper copies as the function (itself). wrapt is imported on first use.
"""

from __future__ import annotations

import copy
from typing import Any, List

_CLASS: List[Any] = []  # the wrapper class, built once wrapt is imported


def function_wrapper(wrapped: Any, wrapper: Any) -> Any:
    """``wrapt.FunctionWrapper(wrapped, wrapper)``, copyable."""
    if not _CLASS:
        _CLASS.append(_build())
    return _CLASS[0](wrapped, wrapper)


def _build() -> Any:
    import wrapt

    class CopyableBoundFunctionWrapper(wrapt.BoundFunctionWrapper):
        def __deepcopy__(self, memo: Any) -> Any:
            instance = self._self_instance
            if instance is None or self._self_parent is None:
                return self
            copied = copy.deepcopy(instance, memo)
            return self._self_parent.__get__(copied, type(copied))

        def __copy__(self) -> Any:
            return self

    class CopyableFunctionWrapper(wrapt.FunctionWrapper):
        __bound_function_wrapper__ = CopyableBoundFunctionWrapper

        def __deepcopy__(self, memo: Any) -> Any:
            return self

        def __copy__(self) -> Any:
            return self

    return CopyableFunctionWrapper
