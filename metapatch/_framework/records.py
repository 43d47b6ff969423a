"""The shape of a patch: plain records, no behaviour.

A patch module (``metapatch/patches/<id>.py``) builds one :class:`Patch` and names it ``PATCH``.
Everything here is import-cheap: no torch, no Hugging Face package, no packaging.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Mapping, Optional, Tuple

# Plain classes rather than dataclasses: `import dataclasses` (and the inspect it pulls in) would
# double the cost of `import metapatch`, which runs at the top of every user script.


class State(str, enum.Enum):
    APPLIED = "applied"
    PENDING_IMPORT = "pending-import"
    NOT_AFFECTED = "not-affected"
    NOT_MEASURED = "not-measured"  # an installed version outside tested_versions.SUPPORT_WINDOW
    STALE = "stale"
    CONFLICT = "conflict"  # another library already replaced the target
    DISABLED = "disabled"
    FAILED = "failed"

    def __str__(self) -> str:  # so f-strings and JSON read "applied", not "State.APPLIED"
        return self.value


class MetapatchWarning(UserWarning):
    """A patch could not be applied (stale, conflict or failed); the program goes on without it."""


class MetapatchError(RuntimeError):
    """Raised for stale/conflict/failed patches under METAPATCH_STRICT=1, and by patches whose
    diagnosis is that the user's request cannot be honoured safely (the message says what to do)."""


class Target:
    """One object a patch replaces.

    ``module`` is the module that defines it and ``qualname`` its path inside that module
    (``"QuantState.as_dict"``). ``fingerprints`` are :func:`metapatch._framework.registry.fingerprint`
    values of the upstream source the patch was written against; any other source makes the
    patch ``stale``. Exactly one of ``wrapper`` (a wrapt wrapper ``(wrapped, instance, args,
    kwargs)``) or ``replacement`` (a factory ``original -> new object``, for hot paths where a
    proxy would cost a call or confuse ``torch.compile``) is given. ``aliases`` are other
    ``"module:attribute"`` sites that re-export the same object; they are patched and restored
    with it.
    """

    __slots__ = ("module", "qualname", "fingerprints", "wrapper", "replacement", "aliases")

    def __init__(self, module: str, qualname: str, fingerprints: Tuple[str, ...], *,
                 wrapper: Optional[Callable[..., Any]] = None,
                 replacement: Optional[Callable[[Any], Any]] = None,
                 aliases: Tuple[str, ...] = ()) -> None:
        if (wrapper is None) == (replacement is None):
            raise ValueError(f"{module}:{qualname}: give exactly one of wrapper= or replacement=")
        self.module = module
        self.qualname = qualname
        self.fingerprints = (fingerprints,) if isinstance(fingerprints, str) else tuple(fingerprints)
        self.wrapper = wrapper
        self.replacement = replacement
        self.aliases = tuple(aliases)

    def __repr__(self) -> str:
        return f"Target({self.dotted!r})"

    @property
    def dotted(self) -> str:
        return f"{self.module}:{self.qualname}"


class Project:
    """An upstream project metapatch patches: the GitHub repository of an import package, and the folder
    of the repository the package lives in (``src/`` unless given: gguf is llama.cpp's ``gguf-py/``)."""

    __slots__ = ("package", "repository", "package_folder")

    def __init__(self, package: str, repository: str, package_folder: str = "src/") -> None:
        self.package, self.repository, self.package_folder = package, repository, package_folder

    def __repr__(self) -> str:
        return f"Project({self.package!r}, {self.repository!r})"


# Read by the diff checks (where a diff's package sections are) and `metapatch pr` (where the PR goes).
PROJECTS = {project.package: project for project in (
    Project("accelerate", "huggingface/accelerate"),
    Project("peft", "huggingface/peft"),
    Project("transformers", "huggingface/transformers"),
    Project("bitsandbytes", "bitsandbytes-foundation/bitsandbytes"),
    Project("gguf", "ggml-org/llama.cpp", package_folder="gguf-py/"),
)}


def project_of(package: str) -> Project:
    """The record of ``package``'s upstream project; an unknown one (a test's fake) has no repository."""
    return PROJECTS.get(package) or Project(package, "")


class Upstream:
    """Where the real fix lives. ``forwarded`` follows DEP-3: "no", "not-needed" or a URL."""

    __slots__ = ("bug", "forwarded", "fixed_in", "note")

    def __init__(self, bug: Tuple[str, ...] = (), forwarded: str = "no",
                 fixed_in: Optional[Mapping[str, str]] = None, note: str = "") -> None:
        self.bug = (bug,) if isinstance(bug, str) else tuple(bug)
        self.forwarded = forwarded
        self.fixed_in = dict(fixed_in or {})
        self.note = note

    @property
    def link(self) -> str:
        if self.forwarded not in ("no", "not-needed", ""):
            return self.forwarded
        return self.bug[0] if self.bug else ""


class Patch:
    """One version-gated fix.

    ``affects`` maps a distribution name to a specifier string; the patch is needed when every
    listed distribution is installed at a version inside its range (pre-releases, dev and local
    builds included). Leave the upper end open while no upstream release has the fix: the
    fingerprints notice when upstream changes the code instead.

    ``wraps_over`` names the patches whose replacements this one goes over where both replace one
    target (each for its own bug): the registry applies those first, keeps that order whichever is
    imported or installed first, and takes this one off and puts it back when one of them is unpatched.

    ``diffs`` are found in ``upstream_diffs/<id>/`` (:func:`metapatch._framework.layout.diffs`); only a
    test's fake patch, whose diffs live elsewhere, lists them (shipped records never do: a test checks).

    ``selftest`` is the selftest module of the patch's own scenarios, ``selftest/<id>.py``
    (:func:`metapatch._framework.layout.scenarios`); a record names one only when it has no scenario of
    its own and is exercised by another patch's.

    ``diagnoses`` lists the :func:`metapatch.diagnose` finding codes this patch fixes, so that a
    finding names it (``"tied-split"``, ``"offloaded"``).

    ``adopt_existing`` is called with the target module each time the patch becomes applied (every target in
    place) to a module that had finished importing before (``import metapatch`` after the target, ``install()``
    after ``unpatch()``), after the swap and outside the registry's lock: for the objects upstream made while the
    patch was not there (a model dispatched before ``import metapatch``). Never while the module is still executing
    (the usual order: no such object can exist yet). What it raises is logged, never raised.
    """

    __slots__ = ("id", "title", "affects", "targets", "upstream", "declared_diffs", "declared_selftest",
                 "wraps_over", "diagnoses", "adopt_existing")

    def __init__(self, id: str, title: str, affects: Mapping[str, str], targets: Tuple[Target, ...], *,  # noqa: A002
                 upstream: Optional[Upstream] = None, diffs: Optional[Tuple[str, ...]] = None,
                 selftest: Optional[str] = None, wraps_over: Tuple[str, ...] = (),
                 diagnoses: Tuple[str, ...] = (), adopt_existing: Optional[Callable[[Any], None]] = None) -> None:
        if not targets:
            raise ValueError(f"patch {id!r} has no targets")
        self.id = id
        self.title = title
        self.affects = dict(affects)
        self.targets = tuple(targets)
        self.upstream = upstream or Upstream()
        self.declared_diffs = None if diffs is None else tuple(diffs)  # None: derived (layout.diffs)
        self.declared_selftest = selftest  # None: derived (layout.scenarios)
        self.wraps_over = (wraps_over,) if isinstance(wraps_over, str) else tuple(wraps_over)
        self.diagnoses = (diagnoses,) if isinstance(diagnoses, str) else tuple(diagnoses)
        self.adopt_existing = adopt_existing

    def __repr__(self) -> str:
        return f"Patch({self.id!r})"

    @property
    def modules(self) -> Tuple[str, ...]:
        seen: dict = {}
        for target in self.targets:
            seen.setdefault(target.module, None)
        return tuple(seen)
