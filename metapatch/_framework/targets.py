"""Reading patch targets: the source fingerprint of an upstream object, the object a dotted target
names, and whether another library already replaced it. Shared by the registry and the CLI
(``metapatch fingerprint``); knows nothing about any particular patch."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from .records import Target

# The attribute that marks an installed object: (patch id, target dotted path, original object).
# The "_self_" prefix keeps wrapt proxies from forwarding the attribute to the wrapped function.
MARKER = "_self_metapatch"


# ---------------------------------------------------------------------------------------------
# Source fingerprints


def source_object(obj: Any) -> Any:
    """The plain function behind descriptors and wrappers, whose source we can read."""
    for _ in range(10):
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif isinstance(obj, property):
            obj = obj.fget
        elif hasattr(obj, "__wrapped__") and getattr(obj, MARKER, None) is not None:
            obj = obj.__wrapped__
        else:
            return obj
    return obj


def fingerprint(obj: Any) -> str:
    """A short hash of an object's source code that ignores formatting, comments and docstrings,
    so upstream reformatting does not make a patch stale but any change to the logic does."""
    import inspect

    from .fingerprints import fingerprint_source  # shared with the static reader (metapatch survey)

    return fingerprint_source(inspect.getsource(source_object(obj)))


def resolve(module: Any, qualname: str) -> Tuple[Any, str, Any]:
    """(parent object, attribute name, raw object as stored on the parent).

    For class attributes the raw object comes from the class ``__dict__`` (so a staticmethod is
    restored as the very same staticmethod), and it must be defined on that class itself:
    patching an inherited method through a subclass would change the wrong class."""
    *parents, attr = qualname.split(".")
    parent = module
    for name in parents:
        parent = getattr(parent, name)
    if isinstance(parent, type):
        if attr not in vars(parent):
            raise AttributeError(f"{parent.__qualname__} defines no attribute {attr!r} itself")
        return parent, attr, vars(parent)[attr]
    return parent, attr, getattr(parent, attr)


# Packages whose decorators legitimately wrap upstream functions at definition time
# (``@torch.no_grad()``, ``@functools.lru_cache``): such a wrapper is not another library's patch.
_DECORATOR_PACKAGES = frozenset({"functools", "contextlib", "typing", "typing_extensions", "torch", "abc"})


def package_of(module_name: Optional[str]) -> str:
    return (module_name or "").partition(".")[0]


def code_owner(obj: Any) -> Optional[str]:
    """The module whose code defines ``obj`` (a function's globals, else its ``__module__``)."""
    globals_ = getattr(obj, "__globals__", None)
    if isinstance(globals_, dict) and isinstance(globals_.get("__name__"), str):
        return globals_["__name__"]
    owner = getattr(obj, "__module__", None)
    return owner if isinstance(owner, str) else None


def replaced_by(module: Any, target: Target, raw: Any = None) -> Optional[str]:
    """The module of another library that replaced or wrapped ``target``, or None.

    A class on the qualname path defined elsewhere (``modeling_llama.LlamaRMSNorm =
    LigerRMSNorm``), a function whose code lives in another package (``unsloth``), a
    ``functools.wraps`` or wrapt wrapper from another package: all of these are someone else's
    patch, which metapatch must neither wrap nor call ``stale``."""
    parent = module
    for name in target.qualname.split(".")[:-1]:
        parent = getattr(parent, name, None)
        if isinstance(parent, type) and package_of(parent.__module__) != package_of(target.module):
            return parent.__module__
    if raw is None:
        return None
    obj = source_object(raw) if getattr(raw, MARKER, None) is None else raw
    if getattr(obj, MARKER, None) is not None:
        return None  # metapatch's own (an earlier registry); adopted elsewhere
    wrapper = getattr(obj, "_self_wrapper", None)  # a wrapt FunctionWrapper (its type's __module__ is "builtins")
    if wrapper is not None and hasattr(obj, "__wrapped__"):
        owner = code_owner(wrapper)
        return owner if owner and package_of(owner) != package_of(target.module) else None
    chain = [obj]
    while hasattr(chain[-1], "__wrapped__") and len(chain) < 10:
        chain.append(chain[-1].__wrapped__)
    owners = [code_owner(level) for level in chain]
    outer = owners[0]
    if outer is None or package_of(outer) == package_of(target.module):
        return None
    if package_of(outer) in _DECORATOR_PACKAGES and any(package_of(o) == package_of(target.module) for o in owners[1:]):
        return None  # upstream's own function under a torch/functools decorator
    return outer


def initializing(module: Any) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def raw_attribute(parent: Any, attr: str) -> Any:
    return vars(parent).get(attr) if isinstance(parent, type) else getattr(parent, attr, None)
