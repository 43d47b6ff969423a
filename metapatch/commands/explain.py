"""metapatch explain"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

HELP = ("read a traceback (file or - for stdin) and name the metapatch patch and the public reports with the "
        "same mechanism, with what to do; exit 1 when nothing matches")

_FRAME = re.compile(r'File "([^"]+)", line \d+, in ([\w.<>]+)')
_PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "gguf", "diffusers")
MAX_REPORTS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", default="-", metavar="FILE|-",
                        help="a file holding the traceback, or - (the default) to read stdin")


def frames(text: str) -> List[Tuple[str, str]]:
    """(module, function) of every frame in a Python traceback whose file is in a known package."""
    found = []
    for path, function in _FRAME.findall(text):
        module = _module_of(path.replace("\\", "/"))
        if module:
            found.append((module, function.split(".")[-1]))
    return found


def _module_of(path: str) -> Optional[str]:
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


def _frame_hit(dotted: str, seen: Sequence[Tuple[str, str]]) -> bool:
    module, _, qualname = dotted.partition(":")
    return (module, qualname.split(".")[-1]) in seen


def _patch_targets() -> Dict[str, Any]:
    """patch id -> record (patch modules are import-cheap: no torch, no Hugging Face package)."""
    import metapatch

    return {pid: metapatch.registry.patches[pid] for pid in metapatch.registry.patches}


def match(text: str) -> Dict[str, Any]:
    """The patches and corpus reports that match a traceback, best first."""
    from metapatch.reports import reports

    seen = frames(text)
    records = _patch_targets()
    patch_scores: Dict[str, int] = {}
    for pid, record in records.items():
        hits = sum(_frame_hit(t.dotted, seen) for t in record.targets)
        if hits:
            patch_scores[pid] = 3 * hits
    scored = []
    for report in reports():
        signature_hits = sum(1 for pattern in report.signatures if re.search(pattern, text))
        frame_list = list(report.frames)
        for pid in filter(None, (report.patch, *report.extra_patches)):
            frame_list += [t.dotted for t in records[pid].targets] if pid in records else []
        frame_hits = sum(_frame_hit(f, seen) for f in set(frame_list))
        if not signature_hits and not frame_hits:
            continue
        score = 2 * signature_hits + 3 * frame_hits
        scored.append((score, report))
        if report.patch and frame_hits:
            patch_scores[report.patch] = max(patch_scores.get(report.patch, 0), score)
    scored.sort(key=lambda item: -item[0])
    best = scored[0][0] if scored else 0
    shown = [report for score, report in scored if score >= best - 2][:MAX_REPORTS]
    # A patch named by the best matching reports counts even when no frame of it is in the traceback
    # (the error surfaces elsewhere, e.g. a forward pass that reads a meta weight).
    for report in shown:
        if report.patch and report.patch not in patch_scores:
            patch_scores[report.patch] = 1
    patches = sorted(patch_scores, key=lambda pid: -patch_scores[pid])
    return {"frames": seen, "patches": patches, "reports": shown}


def advice(report: Any, state: Optional[Dict[str, Any]]) -> str:
    from metapatch.reports import FIXED_BY_METAPATCH, FIXED_UPSTREAM, NEEDS_GPU, NOT_META_BUG

    upgrade = ", ".join(f"{d} to >= {v}" for d, v in report.fixed_upstream_in.items())
    if report.status == FIXED_BY_METAPATCH:
        return _patch_advice(state, upgrade)
    if report.status == FIXED_UPSTREAM:
        return f"upgrade {upgrade}. {report.reason}"
    if report.status == NOT_META_BUG:
        return f"not a meta-device bug: {report.reason}"
    if report.status == NEEDS_GPU:
        return f"needs a GPU to reproduce; not classified here: {report.reason}"
    return f"not fixed yet: {report.reason}"


def _patch_advice(state: Optional[Dict[str, Any]], upgrade: str) -> str:
    also = f" (or upgrade {upgrade})" if upgrade else ""
    fix = ("put `import metapatch` at the top of your script, or start programs you do not edit with "
           "`metapatch run -- python your_script.py`" + also)
    if state is None:
        return fix
    name = state["state"]
    if name in ("applied", "pending-import"):
        return f"{fix}; in this environment the patch is {name}"
    if name == "disabled":
        return f"the patch is disabled here ({state['reason']}): remove it from METAPATCH_DISABLE"
    if name == "not-affected":
        return (f"this environment is not affected ({state['reason']}); where the traceback came from: {fix}")
    if name == "not-measured":
        return f"{state['reason']}"
    return f"the patch is {name} here ({state['reason']}); see `metapatch status`"


def render(found: Dict[str, Any], states: Dict[str, Dict[str, Any]]) -> str:
    import metapatch

    lines = []
    for pid in found["patches"]:
        state = states.get(pid)
        record = metapatch.registry.patches[pid]
        lines.append(f"patch {pid}: {record.title}")
        if state is not None:
            lines.append(f"  state here: {state['state']} ({state['reason']})")
        if record.upstream.link:
            lines.append(f"  upstream:   {record.upstream.link}")
    if found["reports"]:
        lines.append("")
        lines.append("public reports with the same mechanism (docs/reports.md):")
    for report in found["reports"]:
        lines.append(f"- {report.title} ({report.tracker}) [{report.status}]")
        lines.append(f"  {report.url}")
        lines.append(f"  mechanism: {report.mechanism}")
        lines.append(f"  what to do: {advice(report, states.get(report.patch) if report.patch else None)}")
    if found["patches"] and not found["reports"]:
        lines.append("what to do: " + _patch_advice(states.get(found["patches"][0]), ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import metapatch

    if args.file == "-":
        text = sys.stdin.read()
    else:
        with open(args.file, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    found = match(text)
    if not found["patches"] and not found["reports"]:
        print("no match: this traceback shows none of the meta-device errors metapatch knows (no patch target "
              "among its frames, no known error message). `metapatch doctor CHECKPOINT_DIR` inspects a "
              "model's placement; docs/reports.md lists the known reports.")
        return 1
    states = {row["id"]: row for row in metapatch.status()}
    print(render(found, states))
    return 0
