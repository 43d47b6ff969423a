"""metapatch: version-gated fixes for meta-device bugs in torch / accelerate / peft /
bitsandbytes / transformers when a model is split across GPUs, CPU and disk.

``import metapatch`` registers every patch; each one applies when its target module is imported
(before or after metapatch), only where the installed version has the bug. Nothing heavy is
imported here: not torch, not any Hugging Face package, and no patch module until one of its
targets is imported.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

from ._framework import firing as _firing
from ._framework.records import MetapatchError, MetapatchWarning, Patch, State, Target, Upstream
from ._framework.registry import Registry, shared_registry

__version__ = "0.5.4"
__all__ = [
    "MetapatchError", "MetapatchWarning", "Patch", "State", "Target", "Upstream",
    "diagnose", "install", "registry", "status", "unpatch",
]


registry: Registry = shared_registry()


def install(ids: Optional[Iterable[str]] = None) -> None:
    """(Re-)apply patches; idempotent. ``import metapatch`` already did this for all of them."""
    registry.install(ids)


def unpatch(id: Optional[str] = None) -> None:  # noqa: A002 - the documented keyword
    """Restore the exact original objects for one patch id, or for all of them."""
    registry.unpatch(None if id is None else [id])


def status() -> List[Dict[str, Any]]:
    """One dict per patch: id, title, state, reason, installed versions, affected range, upstream."""
    return registry.status()


def diagnose(model: Any) -> Any:
    """What is wrong with a loaded model's placement (see metapatch.diagnose)."""
    from .diagnose import diagnose as _diagnose

    return _diagnose(model)


install()
if _firing.enabled():  # METAPATCH_DEBUG=1: which patches ran, at exit
    _firing.report_at_exit(registry)
