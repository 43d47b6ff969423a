"""The shape of a patch: plain records, no behaviour.

A patch module (``metapatch/patches/<id>.py``) builds one :class:`Patch` and names it ``PATCH``.
Everything here is import-cheap: no torch, no Hugging Face package, no packaging.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Tuple


class State(str, enum.Enum):
    APPLIED = "applied"
    PENDING_IMPORT = "pending-import"
    NOT_AFFECTED = "not-affected"
    STALE = "stale"
    DISABLED = "disabled"
    FAILED = "failed"

    def __str__(self) -> str:  # so f-strings and JSON read "applied", not "State.APPLIED"
        return self.value


class MetapatchWarning(UserWarning):
    """A patch could not be applied (stale or failed); the program goes on without it."""


class MetapatchError(RuntimeError):
    """Raised for stale/failed patches under METAPATCH_STRICT=1, and by patches whose diagnosis
    is that the user's request cannot be honoured safely (the message says what to do)."""


@dataclass(frozen=True)
class Target:
    """One object a patch replaces.

    ``module`` is the module that defines it and ``qualname`` its path inside that module
    (``"QuantState.as_dict"``). ``fingerprints`` are :func:`metapatch._registry.fingerprint`
    values of the upstream source the patch was written against; any other source makes the
    patch ``stale``. Exactly one of ``wrapper`` (a wrapt wrapper ``(wrapped, instance, args,
    kwargs)``) or ``replacement`` (a factory ``original -> new object``, for hot paths where a
    proxy would cost a call or confuse ``torch.compile``) is given. ``aliases`` are other
    ``"module:attribute"`` sites that re-export the same object; they are patched and restored
    with it.
    """

    module: str
    qualname: str
    fingerprints: Tuple[str, ...]
    wrapper: Optional[Callable[..., Any]] = None
    replacement: Optional[Callable[[Any], Any]] = None
    aliases: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.wrapper is None) == (self.replacement is None):
            raise ValueError(f"{self.module}:{self.qualname}: give exactly one of wrapper= or replacement=")
        if isinstance(self.fingerprints, str):
            object.__setattr__(self, "fingerprints", (self.fingerprints,))

    @property
    def dotted(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class Upstream:
    """Where the real fix lives. ``forwarded`` follows DEP-3: "no", "not-needed" or a URL."""

    bug: Tuple[str, ...] = ()
    forwarded: str = "no"
    fixed_in: Mapping[str, str] = field(default_factory=dict)
    note: str = ""

    @property
    def link(self) -> str:
        if self.forwarded not in ("no", "not-needed", ""):
            return self.forwarded
        return self.bug[0] if self.bug else ""


@dataclass(frozen=True)
class Patch:
    """One version-gated fix.

    ``affects`` maps a distribution name to a specifier string; the patch is needed when every
    listed distribution is installed at a version inside its range (pre-releases, dev and local
    builds included). Leave the upper end open while no upstream release has the fix: the
    fingerprints notice when upstream changes the code instead.
    """

    id: str
    title: str
    affects: Mapping[str, str]
    targets: Tuple[Target, ...]
    upstream: Upstream = Upstream()
    diffs: Tuple[str, ...] = ()
    selftest: Optional[str] = None

    @property
    def modules(self) -> Tuple[str, ...]:
        seen: dict = {}
        for target in self.targets:
            seen.setdefault(target.module, None)
        return tuple(seen)
