"""Reading a wrapped call's arguments by name, for wrappers whose upstream signature has many
optional parameters passed either way."""

from __future__ import annotations

from typing import Any, Dict

_SIGNATURES: Dict[Any, Any] = {}


def signature_of(func: Any) -> Any:
    signature = _SIGNATURES.get(func)
    if signature is None:
        import inspect  # here, not at module level: `import metapatch` must stay cheap

        signature = _SIGNATURES[func] = inspect.signature(func)
    return signature


def call_arguments(func: Any, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """Every parameter of ``func`` for this call, defaults filled in."""
    bound = signature_of(func).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def keyword_names(func: Any) -> frozenset:
    """The parameters of ``func`` a call may pass by keyword (a keyword outside them is refused, unless ``func``
    takes ``**kwargs``, whose name is not among them)."""
    return frozenset(name for name, p in signature_of(func).parameters.items()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
