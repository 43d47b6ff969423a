"""metapatch explain"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import UsageError
from ._explain_evidence import UBIQUITOUS_FRAMES, Traceback, module_of, parse, rank

HELP = ("read a traceback (a file, or - for stdin) and rank the metapatch patches that fix it, each with the "
        "evidence for it, plus the public reports with the same mechanism and what to do")

EPILOG = """Evidence: the final error against what each patch's reproducers raise without metapatch, the
patches' target functions among the frames, your own lines (model.to(torch.float16), ids.to(model.device),
resize_token_embeddings, ...), and library frames that show how the bug surfaces. The first patch is the
most likely one; each comes with its reasons and its state on this install.

examples:
  python train.py 2>&1 | metapatch explain -
  metapatch explain traceback.txt --json

exit code: 0 a patch or report matched; 1 nothing matched; 2 bad input (no such file, a folder, an empty
input, or no FILE with a terminal on stdin: give a file or pipe the traceback in). `metapatch explain -` at
a terminal asks for the traceback and reads a paste, ended by Ctrl-D on a line of its own.
"""

MAX_REPORTS = 5
MAX_CANDIDATES = 5
SHOWN_FRACTION = 0.25  # candidates scoring below this share of the best one are left out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("file", nargs="?", default=None, metavar="FILE|-",
                        help="a file holding the traceback, or - to read stdin")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def frames(text: str) -> List[Tuple[str, str]]:
    """(module, function) of every frame of ``text`` in a known library."""
    return [(f.module, f.function) for f in parse(text).frames if f.module and "/" not in f.module]


def _frame_hit(dotted: str, seen: Sequence[Tuple[str, str]]) -> bool:
    """Whether the traceback passes through ``dotted``; never for a frame every offloaded forward passes through
    (accelerate's hook around each forward): a report matched by it alone would be any offload traceback's."""
    module, _, qualname = dotted.partition(":")
    key = (module, qualname.split(".")[-1])
    return key in seen and key not in UBIQUITOUS_FRAMES


def _reports(text: str, seen: Sequence[Tuple[str, str]], records: Dict[str, Any]) -> List[Any]:
    """The corpus reports whose error text or frames match, best first."""
    from metapatch.reports import reports

    scored = []
    for report in reports():
        signature_hits = sum(1 for pattern in report.signatures if re.search(pattern, text))
        frame_list = list(report.frames)
        for pid in filter(None, (report.patch, *report.extra_patches)):
            frame_list += [t.dotted for t in records[pid].targets] if pid in records else []
        frame_hits = sum(_frame_hit(f, seen) for f in set(frame_list))
        if not signature_hits and not frame_hits:
            continue
        scored.append((2 * signature_hits + 3 * frame_hits, report))
    scored.sort(key=lambda item: -item[0])
    best = scored[0][0] if scored else 0
    return [report for score, report in scored if score >= best - 2][:MAX_REPORTS]


def match(text: str, states: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """The ranked candidates (with their reasons) and the matching corpus reports for a traceback."""
    import metapatch

    registry = metapatch.registry
    if states is None:
        states = {row["id"]: row for row in metapatch.status()}
    trace = parse(text)
    seen = frames(text)
    shown_reports = _reports(text, seen, dict(registry.patches))
    candidates = rank(trace, registry, states, shown_reports)
    if candidates:
        best = candidates[0].score
        candidates = [c for c in candidates if c.score >= SHOWN_FRACTION * best][:MAX_CANDIDATES]
    return {"trace": trace, "frames": seen, "candidates": candidates,
            "patches": [c.patch for c in candidates], "reports": shown_reports}


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
        return f"this environment is not affected ({state['reason']}); where the traceback came from: {fix}"
    if name == "not-measured":
        return f"{state['reason']}"
    return f"the patch is {name} here ({state['reason']}); see `metapatch status`"


def _evidence_lines(trace: Traceback) -> List[str]:
    out = [f"error: {trace.error.splitlines()[0][:160] if trace.error else '(no exception line found)'}"]
    user = trace.user_frames
    if user:
        last = user[-1]
        out.append(f"your line: {last.path}:{last.line} `{last.source[:120]}`" if last.source
                   else f"your frame: {last.path}:{last.line} in {last.function}")
    libraries = [f for f in trace.frames if f.module and "/" not in f.module]
    if libraries:
        out.append(f"raised in: {libraries[-1].module}.{libraries[-1].function}")
    return out


def render(found: Dict[str, Any], states: Dict[str, Dict[str, Any]]) -> str:
    import metapatch

    lines = _evidence_lines(found["trace"])
    lines.append("")
    for rank_number, candidate in enumerate(found["candidates"], 1):
        record = metapatch.registry.patches[candidate.patch]
        label = "most likely" if rank_number == 1 else "also possible"
        lines.append(f"{rank_number}. patch {candidate.patch} ({label}): {record.title}")
        for reason in candidate.reasons:
            lines.append(f"   - {reason}")
        state = states.get(candidate.patch)
        if state is not None:
            lines.append(f"   state here: {state['state']} ({state['reason']})")
        if record.upstream.link:
            lines.append(f"   upstream:   {record.upstream.link}")
    if found["reports"]:
        lines.append("")
        lines.append("public reports with the same mechanism (docs/reports.md):")
    for report in found["reports"]:
        lines.append(f"- {report.title} ({report.tracker}) [{report.status}]")
        lines.append(f"  {report.url}")
        lines.append(f"  mechanism: {report.mechanism}")
        lines.append(f"  what to do: {advice(report, states.get(report.patch) if report.patch else None)}")
    if found["candidates"]:
        lines.append("")
        lines.append("what to do: " + _patch_advice(states.get(found["candidates"][0].patch), ""))
    return "\n".join(lines)


def to_json(found: Dict[str, Any], states: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    import metapatch

    trace = found["trace"]
    user = trace.user_frames
    return {
        "error_type": trace.error_type,
        "error": trace.error,
        "user_line": ({"file": user[-1].path, "line": user[-1].line, "source": user[-1].source} if user else None),
        "frames": [{"module": m, "function": f} for m, f in found["frames"]],
        "candidates": [{"rank": n, "patch": c.patch, "score": round(c.score, 3), "reasons": c.reasons,
                        "title": metapatch.registry.patches[c.patch].title,
                        "state": (states.get(c.patch) or {}).get("state"),
                        "state_reason": (states.get(c.patch) or {}).get("reason"),
                        "upstream": metapatch.registry.patches[c.patch].upstream.link or None}
                       for n, c in enumerate(found["candidates"], 1)],
        "reports": [{"id": r.id, "title": r.title, "url": r.url, "status": r.status, "patch": r.patch,
                     "mechanism": r.mechanism, "what_to_do": advice(r, states.get(r.patch) if r.patch else None)}
                    for r in found["reports"]],
        "what_to_do": _patch_advice(states.get(found["candidates"][0].patch), "") if found["candidates"] else None,
    }


_PASTE_HELP = ("paste nothing here: give the traceback as a file (`metapatch explain traceback.txt`), or pipe it in "
               "(`python train.py 2>&1 | metapatch explain -`)")


def read_input(name: Optional[str]) -> str:
    """The traceback text; UsageError for a missing file, a folder, or a terminal with nothing piped in."""
    from pathlib import Path

    if name is None or name == "-":
        if sys.stdin is None or sys.stdin.isatty():
            if name is None:
                raise UsageError(f"no traceback given; {_PASTE_HELP}")
            print("metapatch explain: paste the traceback, then press Ctrl-D on a line of its own "
                  "(Ctrl-Z then Enter on Windows)", file=sys.stderr, flush=True)
        text = sys.stdin.read()
        where = "stdin"
    else:
        path = Path(name)
        if path.is_dir():
            raise UsageError(f"{name} is a folder; give the file that holds the traceback")
        if not path.exists():
            raise UsageError(f"{name}: no such file")
        text = path.read_bytes().decode("utf-8", errors="replace")
        where = name
    if not text.strip():
        raise UsageError(f"{where} is empty: no traceback to explain")
    return text


def run(args: argparse.Namespace) -> int:
    import metapatch

    text = read_input(args.file)
    states = {row["id"]: row for row in metapatch.status()}
    found = match(text, states)
    if not found["candidates"] and not found["reports"]:
        message = ("no match: this traceback shows none of the meta-device errors metapatch knows (no patch target "
                   "among its frames, no known error message). `metapatch doctor CHECKPOINT_DIR` inspects a "
                   "model's placement; docs/reports.md lists the known reports.")
        if args.json:
            print(json.dumps({**to_json(found, states), "match": False, "message": message}, indent=2))
        else:
            print(message)
        return 1
    if args.json:
        print(json.dumps({**to_json(found, states), "match": True}, indent=2))
    else:
        print(render(found, states))
    return 0


__all__ = ["HELP", "add_arguments", "run", "match", "frames", "module_of"]
