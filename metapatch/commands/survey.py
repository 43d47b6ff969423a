"""metapatch survey"""

from __future__ import annotations

import argparse
import json
import sys
import time

HELP = ("patch authors: measure a patch on every release in the support window (fingerprints from the "
        "wheels, code variants, and with --run the reproducers unpatched/patched/with the upstream diff "
        "in cached venvs) and write its table to metapatch/survey/tables/<id>.json")

EPILOG = """The table is what `affects` and the Target fingerprints must agree with; `--check` (and
tests/test_survey.py) fails, naming what to change, when they do not. Downloads, venvs and results
are cached in ~/.cache/metapatch/survey ($METAPATCH_SURVEY_CACHE): a rerun resumes.

examples:
  metapatch survey --all --static              refresh every table's fingerprints and variants
  metapatch survey tied-device-map-meta-pointer --run --max-combos 2
  metapatch survey bnb-quant-state-offload --check
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("patch_ids", nargs="*", metavar="PATCH_ID")
    parser.add_argument("--all", action="store_true", help="every registered patch")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--static", action="store_true", help="fingerprints and variants only (the default)")
    mode.add_argument("--run", action="store_true", help="also run the reproducers on each variant's newest and oldest release (--ends)")
    mode.add_argument("--check", action="store_true",
                      help="measure nothing: exit 1 when the Patch record disagrees with its committed table")
    mode.add_argument("--show", action="store_true", help="print the committed table, measure nothing")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    parser.add_argument("--max-combos", type=int, default=2, metavar="N",
                        help="companion combinations per variant with --run (default 2: all newest, all oldest)")
    parser.add_argument("--ends", choices=("both", "newest"), default="both",
                        help="with --run: measure each variant's newest and oldest release (default), or only "
                             "its newest (one release per variant: half the runs)")
    parser.add_argument("--dist", action="append", default=[], metavar="NAME",
                        help="with --run: only run the variants of this distribution (repeatable)")
    parser.add_argument("--timeout", type=float, default=300, metavar="SECONDS", help="per scenario run")
    parser.add_argument("--workers", type=int, default=4, help="parallel downloads (default 4)")
    parser.add_argument("--refresh", action="store_true", help="re-read PyPI's release lists now")
    parser.add_argument("--no-write", action="store_true", help="do not write the table or docs/survey")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _docs_path(patch_id: str):
    from metapatch.survey.runner import REPO

    return REPO / "docs" / "survey" / f"{patch_id}.md"


def _check(patch, table) -> int:
    from metapatch.survey import check

    if table is None:
        print(f"{patch.id}: no survey table; run `metapatch survey {patch.id}`")
        return 1
    found = check.problems(patch, table)
    for line in found:
        print(line)
    static_rows = check.static_only(table)
    if not found:
        print(f"{patch.id}: the record agrees with its survey table"
              + (f" (fingerprints only for {len(static_rows)} rows never run)" if static_rows else ""))
    return 1 if found else 0


def run(args: argparse.Namespace) -> int:
    import metapatch
    from metapatch.survey import plan, table as tables

    registry = metapatch.registry
    ids = list(registry.patches) if args.all else args.patch_ids
    unknown = [i for i in ids if i not in registry.patches]
    if not ids or unknown:
        print(f"metapatch survey: name patch id(s) or --all; unknown: {', '.join(unknown) or '-'}; "
              f"known: {', '.join(registry.patches)}", file=sys.stderr)
        return 2
    code = 0
    for patch_id in ids:
        patch = registry.patches[patch_id]
        old = tables.read(patch_id)
        if args.check:
            code |= _check(patch, old)
            continue
        if args.show:
            table = old
        else:
            started = time.perf_counter()
            table = plan.static_table(patch, args.refresh, args.workers, _log)
            plan.carry_runs(table, old)
            if args.run:
                plan.run_table(table, patch, args.max_combos, args.timeout, args.dist, _log, args.ends)
            _log(f"{patch_id}: surveyed in {time.perf_counter() - started:.0f} s")
            if not args.no_write:
                _log(f"wrote {tables.write(table)}")
                docs = _docs_path(patch_id)
                docs.parent.mkdir(parents=True, exist_ok=True)
                docs.write_text(tables.render_markdown(table) + "\n")
        if table is None:
            print(f"{patch_id}: no survey table; run `metapatch survey {patch_id}`")
            code = 1
        elif args.json:
            print(json.dumps(table, indent=1, sort_keys=True))
        else:
            print(tables.render_text(table))
            print("\n".join("  " + line for line in ["variant counts:"] + tables.variant_counts(table)))
    return code
