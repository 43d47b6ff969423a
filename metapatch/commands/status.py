"""metapatch status"""

from __future__ import annotations

import argparse
import json

HELP = "show every patch (or the ones named): state, reason, installed versions, affected range, upstream link"

EPILOG = """examples:
  metapatch status                          every patch
  metapatch status offloaded-model-device   one patch's row
exit code: 0; 1 under METAPATCH_STRICT=1 when a patch shown is stale, conflict or failed; 2 for an unknown
patch id (the close matches are named).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("patch_ids", nargs="*", metavar="PATCH_ID", help="only these patches (default: every one)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--import-targets", action="store_true",
                        help="import each patch's target modules first, so states are final rather than pending-import")


def run(args: argparse.Namespace) -> int:
    import importlib

    import difflib

    import metapatch
    from metapatch._registry import strict_mode

    from . import UsageError

    known = list(metapatch.registry.patches)
    wanted = list(getattr(args, "patch_ids", None) or [])
    unknown = [pid for pid in wanted if pid not in metapatch.registry.patches]
    if unknown:
        close = sorted({m for pid in unknown for m in difflib.get_close_matches(pid, known, n=3, cutoff=0.5)})
        raise UsageError(f"unknown patch id(s) {', '.join(unknown)}"
                         + (f"; did you mean {', '.join(close)}?" if close else "; `metapatch status` lists them"))
    if args.import_targets:
        for row in metapatch.status():
            if row["state"] != "pending-import":
                continue
            for target in row["targets"]:
                try:
                    importlib.import_module(target.split(":")[0])
                except ImportError:
                    pass  # reported through the row's state: the distribution is missing
    rows = metapatch.status()
    if wanted:
        rows = [row for row in rows if row["id"] in wanted]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows))
    # not-measured is the truth about an install outside the support window, not an error.
    bad = [r["id"] for r in rows if r["state"] in ERROR_STATES]
    return 1 if bad and strict_mode() else 0


# States that METAPATCH_STRICT=1 turns into an error (the registry raises for them too).
ERROR_STATES = ("stale", "conflict", "failed")


def format_table(rows: list) -> str:
    if not rows:
        return "no patches registered"
    out = []
    for row in rows:
        versions = ", ".join(f"{d} {v or 'not installed'}" for d, v in row["installed"].items())
        affects = ", ".join(f"{d}{s}" for d, s in row["affects"].items())
        out.append(f"{row['id']}: {row['state']}")
        out.append(f"    {row['title']}")
        out.append(f"    reason:    {row['reason']}")
        out.append(f"    installed: {versions}")
        out.append(f"    affects:   {affects}")
        if row["fixed_in"]:
            out.append("    fixed in:  " + ", ".join(f"{d} {v}" for d, v in row["fixed_in"].items()))
        out.append(f"    upstream:  {row['upstream'] or '(not filed yet)'} [forwarded: {row['forwarded']}]")
        for note in row["notes"]:
            out.append(f"    note:      {note}")
    unmeasured = [row["id"] for row in rows if row["state"] == "not-measured"]
    if unmeasured:
        out.append("")
        out.append(f"NOT MEASURED: {', '.join(unmeasured)}: an installed version is outside metapatch's "
                   "support window, so these patches are not applied and metapatch cannot say whether the "
                   "bugs exist here. Run `metapatch selftest` to find out.")
    conflicts = [row["id"] for row in rows if row["state"] == "conflict"]
    if conflicts:
        out.append("")
        out.append(f"CONFLICT: {', '.join(conflicts)}: another library already replaced the target "
                   "(named in the reason); metapatch left it alone.")
    return "\n".join(out)
