"""What a marked placeholder is while its offload hook loads its value: a quiet sibling of its marked class.

accelerate reads each placeholder about eight times as it loads it (``is_meta``, ``device``, ``shape``, ``dtype``,
``requires_grad``, ``data_ptr()``); through the marked class's ``__torch_function__``
(:mod:`metapatch._offload.placeholder_classes`) each read is a Python call. The sibling has the unmarked class's
``__torch_function__`` instead, and everything else of the marked class. Switching placeholders to it and back is
:func:`metapatch._offload.placeholder_writes.quieted` / ``restored``.

Nothing here imports torch at import time.
"""

from __future__ import annotations

from typing import Any, Dict

# A marked class -> its quiet sibling, and back
QUIET: Dict[Any, Any] = {}
LOUD: Dict[Any, Any] = {}


def quiet_sibling(marked: Any, unmarked_torch_function: Any) -> Any:
    """``marked`` with the unmarked class's ``__torch_function__`` (torch's disabled one, or bitsandbytes' own): what a
    placeholder is while its hook loads its value (:func:`metapatch._offload.placeholder_writes.quieted`).

    accelerate reads each placeholder about eight times as it loads it (``is_meta``, ``device``, ``shape``, ``dtype``,
    ``requires_grad``, ``data_ptr()``); through the marked class's ``__torch_function__`` each read is a Python call
    (about 25 us per offloaded parameter and forward), through this one none is. Everything else (``.data``, the
    writing methods, the slot) is ``marked``'s, and the placeholder gets ``marked`` back when the load returns, so a
    reference held to it still refuses or keeps a write by a torch function afterwards."""
    if unmarked_torch_function is None:  # a bitsandbytes release whose Params4bit has none: nn.Parameter's
        import torch

        unmarked_torch_function = torch._C._disabled_torch_function_impl

    class Quiet(marked):
        __torch_function__ = unmarked_torch_function

    Quiet.__name__, Quiet.__qualname__ = marked.__name__, marked.__qualname__
    QUIET[marked], LOUD[Quiet] = Quiet, marked
    return Quiet
