"""The evidence ``metapatch explain`` ranks patches by, read from a pasted traceback.

Four kinds, each giving a candidate patch points and a reason a user can check:

* the error: the final exception (type and text) against what each patch's reproducers raise without
  metapatch (``Scenario.expected_error``/``expected_message`` and their per-release ``Expect``\\ s): a text that
  only one patch's reproducers show counts more than one several patches share, and a reproducer whose
  expectation holds on the installed versions more than one for other releases;
* the frames: a patch's target functions among the traceback's frames (shared targets count less);
* the user's own lines (frames outside the libraries): what the code was doing (``model.to(torch.float16)``,
  ``ids.to(model.device)``, ``resize_token_embeddings``) against the entry points in ``HINTS``;
* mechanisms: a library frame together with an error text that identifies how the bug surfaces
  (``send_to_device`` failing to copy a meta tensor: the forward's inputs are on meta), also in ``HINTS``.

A patch that is not-affected on the installed versions keeps its evidence but is ranked lower: a traceback
pasted here most often came from here. Import-cheap: no torch, no Hugging Face package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in ([\w.<>]+)\s*$')
_LIBRARY_MARKERS = ("site-packages/", "dist-packages/", "/lib/python", "<frozen", "<string>")
_PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "gguf", "diffusers", "safetensors",
             "huggingface_hub", "metapatch")
# Error classes too common to say anything without a message.
_GENERIC_ERRORS = frozenset({"RuntimeError", "ValueError", "AssertionError", "NotImplementedError", "TypeError",
                             "AttributeError", "Exception"})

USER_LINE, OTHER_USER_LINE, MECHANISM, ERROR_TEXT, FRAME, REPORT = 4.0, 2.0, 4.0, 3.0, 3.0, 1.0
NOT_AFFECTED_FACTOR = 0.6


@dataclass(frozen=True)
class Hint:
    """Evidence for ``patch``: a user line matching ``user``, or a library frame named in ``frames`` with an
    error text matching ``error`` (both given: both needed)."""

    patch: str
    reason: str
    user: str = ""
    frames: Tuple[str, ...] = ()
    error: str = ""


_DTYPE = r"(dtype|float16|bfloat16|float32|float64|half|double)"
HINTS: Tuple[Hint, ...] = (
    Hint("offloaded-model-device", "your code sends tensors to model.device, which is meta when the model's first "
         "parameter is offloaded", user=r"\bto\([^)]*\.device\b|\bdevice\s*=\s*\w+\.device\b"),
    Hint("offloaded-model-device", "accelerate's hook could not move the forward's inputs: they are on meta "
         "(sent to model.device)", frames=("send_to_device",), error=r"Cannot copy out of meta tensor"),
    Hint("offloaded-model-device", "generate() builds its special-token tensors on model.device, which is meta",
         frames=("_prepare_special_tokens",), error=r"meta"),
    Hint("offloaded-model-device-v4", "your code sends tensors to model.device, which is meta when the model's "
         "first parameter is offloaded", user=r"\bto\([^)]*\.device\b|\bdevice\s*=\s*\w+\.device\b"),
    Hint("offloaded-dtype-conversion", "your line converts the model's dtype",
         user=rf"\.to\([^)]*{_DTYPE}|\.(half|bfloat16|float|double)\(\s*\)"),
    Hint("offloaded-move-guard", "your line moves a module to a device",
         user=rf"\.(cuda|cpu)\(|\.to\((?![^)]*{_DTYPE})(?![^)]*\.device\b)"),
    Hint("offloaded-resize-token-embeddings", "your line resizes the token embeddings",
         user=r"resize_token_embeddings\("),
    Hint("transformers-load-adapter-offload", "your line loads an adapter through transformers",
         user=r"\.load_adapter\(|\.add_adapter\("),
    Hint("peft-offload-redispatch", "your line loads or builds a PEFT model",
         user=r"PeftModel|PeftMixedModel|get_peft_model|AutoPeftModel|merge_and_unload|\.load_adapter\("),
    Hint("accelerate-tie-before-load", "your line loads a checkpoint into a model built empty",
         user=r"load_checkpoint_and_dispatch|load_checkpoint_in_model"),
    Hint("empty-init-nonpersistent-buffers", "your line loads a checkpoint into a model built empty",
         user=r"load_checkpoint_and_dispatch|load_checkpoint_in_model|to_empty\("),
    Hint("accelerate-dispatch-skip-keys", "a KeyError on a layer index or an attention kind inside a forward "
         "under accelerate's hooks: the cache was moved between devices", frames=("send_to_device",),
         error=r"KeyError: (\d+|'(sliding|full)_attention')"),
)


@dataclass
class Frame:
    path: str
    line: int
    function: str
    source: str
    module: Optional[str]  # dotted module of a library frame, None for the user's own code


@dataclass
class Traceback:
    frames: List[Frame]
    error_type: str
    error: str  # the final exception's text, type included

    @property
    def user_frames(self) -> List[Frame]:
        return [f for f in self.frames if f.module is None]


@dataclass
class Candidate:
    patch: str
    score: float = 0.0
    reasons: List[str] = field(default_factory=list)

    def add(self, points: float, reason: str) -> None:
        self.score += points
        if reason not in self.reasons:
            self.reasons.append(reason)


def module_of(path: str) -> Optional[str]:
    """The dotted module of a frame in a library (site-packages, or a source checkout of a known package)."""
    path = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            break
    else:
        parts = path.split("/")
        starts = [i for i, part in enumerate(parts) if part in _PACKAGES]
        if not starts:
            return None
        path = "/".join(parts[starts[-1]:])  # .../src/transformers/x.py -> transformers/x.py
    if not path.endswith(".py"):
        return None
    module = path[:-3].replace("/", ".")
    return module[: -len(".__init__")] if module.endswith(".__init__") else module


def _is_library(path: str) -> bool:
    return any(marker in path for marker in _LIBRARY_MARKERS)


def parse(text: str) -> Traceback:
    """Frames and the final error of a Python traceback (the last one where exceptions are chained)."""
    lines = text.splitlines()
    frames: List[Frame] = []
    last_frame_end = -1
    i = 0
    while i < len(lines):
        match = _FRAME.match(lines[i])
        if not match:
            i += 1
            continue
        path, number, function = match.group(1), int(match.group(2)), match.group(3)
        source, j = "", i + 1
        if j < len(lines) and not _FRAME.match(lines[j]) and lines[j].startswith("    "):
            source = lines[j].strip()
            j += 1
            while j < len(lines) and set(lines[j].strip()) <= set("^~ ") and lines[j].strip():
                j += 1  # the ^^^^ markers under the source line
        module = module_of(path)
        if module is None and _is_library(path):
            module = path
        frames.append(Frame(path, number, function.split(".")[-1], source, module))
        last_frame_end, i = j, j
    tail = [line for line in lines[last_frame_end:] if line.strip()] if last_frame_end >= 0 else \
        [line for line in lines if line.strip()]
    error = ""
    for index, line in enumerate(tail):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)\b|^[A-Za-z_][\w.]*:\s", line):
            error = "\n".join(tail[index:])
            break
    if not error and tail:
        error = tail[-1]
    error_type = re.match(r"^([A-Za-z_][\w.]*)", error).group(1).split(".")[-1] if error else ""
    return Traceback(frames, error_type, error.strip())


# -- what each patch's reproducers raise without metapatch -------------------------------------------------


@dataclass(frozen=True)
class Expectation:
    patch: str
    scenario: str
    error: str  # class name(s), "A|B"
    message: str  # regex, "" for any
    here: bool  # holds on the installed versions


def expectations(registry: Any) -> List[Expectation]:
    """Every upstream error the patches' reproducers declare (AssertionErrors are the reproducers' own checks
    of silently wrong results: no user sees them)."""
    from metapatch.selftest import all_scenarios
    from metapatch.selftest._harness import unmet

    found: List[Expectation] = []
    for scenario in all_scenarios():
        patch = registry.patches.get(scenario.patch_id)
        if patch is None:
            continue
        runs_here = not scenario.not_applicable_here()
        declared = [(e.error, e.message, runs_here and unmet(e.when) == "") for e in scenario.unpatched if e.error]
        if scenario.expected_error:
            declared.append((scenario.expected_error, scenario.expected_message,
                             runs_here and registry.gate(patch).affected))
        for error, message, here in declared:
            errors = [e for e in error.split("|") if e and e != "AssertionError"]
            if errors:
                found.append(Expectation(scenario.patch_id, scenario.key, "|".join(errors), message, here))
    return found


def _expectation_matches(expect: Expectation, trace: Traceback) -> bool:
    if trace.error_type not in expect.error.split("|"):
        return False
    if expect.message:
        return re.search(expect.message, trace.error) is not None
    return trace.error_type not in _GENERIC_ERRORS


# -- ranking -----------------------------------------------------------------------------------------------


def rank(trace: Traceback, registry: Any, states: Mapping[str, Mapping[str, Any]],
         reports: Sequence[Any] = ()) -> List[Candidate]:
    """Candidates best first, each with its score and reasons."""
    candidates: Dict[str, Candidate] = {}

    def get(patch_id: str) -> Candidate:
        return candidates.setdefault(patch_id, Candidate(patch_id))

    known = set(registry.patches)
    _error_evidence(trace, registry, get)
    _frame_evidence(trace, registry, get)
    _hint_evidence(trace, known, get)
    for report in reports:
        if report.patch in known and report.patch in candidates:
            get(report.patch).add(REPORT, f"a public report with this error: {report.title} ({report.url})")
    for candidate in candidates.values():
        state = (states.get(candidate.patch) or {}).get("state")
        if state == "not-affected":
            candidate.score *= NOT_AFFECTED_FACTOR
            candidate.reasons.append("but it is not-affected on the installed versions (ranked lower: if the "
                                     "traceback came from this environment, this patch is not the fix)")
    return sorted(candidates.values(), key=lambda c: (-c.score, c.patch))


def _error_evidence(trace: Traceback, registry: Any, get) -> None:
    if not trace.error_type:
        return
    matching = [e for e in expectations(registry) if _expectation_matches(e, trace)]
    here_patches = {e.patch for e in matching if e.here}
    elsewhere_patches = {e.patch for e in matching} - here_patches
    shown = trace.error.splitlines()[0][:100]
    for patch_id in sorted(here_patches):
        scenario = next(e.scenario for e in matching if e.patch == patch_id and e.here)
        get(patch_id).add(ERROR_TEXT / len(here_patches),
                          f"its reproducer {scenario} fails with this error on the installed versions ({shown})")
    for patch_id in sorted(elsewhere_patches):
        scenario = next(e.scenario for e in matching if e.patch == patch_id)
        get(patch_id).add(ERROR_TEXT / (3 * max(1, len(elsewhere_patches))),
                          f"its reproducer {scenario} fails with this error on other releases ({shown})")


# Frames every offloaded module's forward passes through (accelerate's hook around each forward): a patch replacing
# one is on nearly every offload traceback, so being there says little about which bug this is.
UBIQUITOUS_FRAMES = frozenset({("accelerate.hooks", "pre_forward"), ("accelerate.hooks", "new_forward")})


def _frame_evidence(trace: Traceback, registry: Any, get) -> None:
    seen = {(f.module, f.function) for f in trace.frames if f.module}
    owners: Dict[Tuple[str, str], List[str]] = {}
    for patch_id in registry.patches:
        for target in registry.patches[patch_id].targets:
            key = (target.module, target.qualname.split(".")[-1])
            if key in seen:
                owners.setdefault(key, []).append(patch_id)
    for (module, function), patch_ids in owners.items():
        common = (module, function) in UBIQUITOUS_FRAMES
        for patch_id in dict.fromkeys(patch_ids):
            get(patch_id).add(FRAME / len(set(patch_ids)) / (3 if common else 1),
                              f"the traceback passes through {module}.{function}, which this patch replaces"
                              + (" (as every offloaded forward does)" if common else ""))


def _hint_evidence(trace: Traceback, known: set, get) -> None:
    users = trace.user_frames
    innermost = users[-1] if users else None
    functions = {f.function for f in trace.frames if f.module}
    for hint in HINTS:
        if hint.patch not in known:
            continue
        if hint.user:
            hits = [f for f in users if f.source and re.search(hint.user, f.source)]
            if hits:
                points = USER_LINE if innermost in hits else OTHER_USER_LINE
                line = hits[-1]
                get(hint.patch).add(points, f"{hint.reason}: {line.path}:{line.line} `{line.source[:100]}`")
            continue
        if hint.frames and not functions.intersection(hint.frames):
            continue
        if hint.error and not re.search(hint.error, f"{trace.error_type}: {trace.error}" if not
                                        trace.error.startswith(trace.error_type) else trace.error):
            continue
        get(hint.patch).add(MECHANISM, hint.reason)
