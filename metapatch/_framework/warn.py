"""Warnings that reach the user once, at the user's own line.

One channel: :func:`warnings.warn_explicit` at the first frame outside metapatch, the import
machinery, wrapt and the libraries metapatch patches (torch and the Hugging Face stack), so
``-W``/``filterwarnings`` and pytest see it, and the printed location is the line the user wrote
(``model = AutoModel.from_pretrained(...)``), not ``transformers/models/auto/auto_factory.py``.

Nothing goes to the ``metapatch`` logger by default: Python prints an unconfigured logger's
warnings to stderr too, which is how the same message used to appear twice. Code that attached a
handler to the ``metapatch`` logger itself asked for records, and gets one per warning as well.

Import-cheap: sys, threading and warnings only.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any, Hashable, Iterable, Optional, Type

from .records import MetapatchWarning

# Top-level packages whose frames are never "the user's line".
LIBRARY_PACKAGES = frozenset({
    "metapatch", "importlib", "_frozen_importlib", "_frozen_importlib_external", "wrapt",
    "torch", "transformers", "accelerate", "peft", "bitsandbytes", "safetensors", "huggingface_hub",
    "diffusers", "contextlib", "functools", "threading", "runpy",
})

_seen: set = set()
_seen_lock = threading.Lock()


def _is_library_frame(frame: Any, skip: frozenset) -> bool:
    package = (frame.f_globals.get("__name__") or "").partition(".")[0]
    if package in LIBRARY_PACKAGES or package in skip:
        return True
    filename = frame.f_code.co_filename
    return filename.startswith("<frozen importlib")


def user_frame(start: Optional[Any] = None, skip: Iterable[str] = ()) -> Any:
    """The innermost frame that is not library code (nor in a package named in ``skip``: the
    package a patch targets); the outermost frame if every one is."""
    frame = start if start is not None else sys._getframe(1)
    skip = frozenset(skip)
    outermost = frame
    while frame is not None:
        if not _is_library_frame(frame, skip):
            return frame
        outermost = frame
        frame = frame.f_back
    return outermost


def warn(message: str, category: Type[Warning] = MetapatchWarning, skip: Iterable[str] = ()) -> None:
    """Emit ``message`` at the user's frame (the warnings filters decide whether it shows)."""
    frame = user_frame(sys._getframe(1), skip)
    module_globals = frame.f_globals
    registry = module_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__") or "<string>", registry=registry)
    _log_for_subscribers(message)


def warn_once(key: Hashable, message: str, category: Type[Warning] = MetapatchWarning,
              skip: Iterable[str] = ()) -> bool:
    """:func:`warn`, at most once per ``key`` in this process (whatever the warnings filters say).

    Returns whether it was emitted."""
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
    warn(message, category, skip)
    return True


def _log_for_subscribers(message: str) -> None:
    logging = sys.modules.get("logging")
    if logging is None:
        return  # nobody can have attached a handler
    logger = logging.getLogger("metapatch")
    if logger.handlers:
        logger.warning(message)
