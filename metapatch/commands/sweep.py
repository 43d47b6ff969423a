"""metapatch sweep"""

from __future__ import annotations

import argparse
import sys
import time

HELP = ("measure: every causal-LM and seq2seq architecture of the installed transformers, built tiny and "
        "loaded with offload placements, compared with the in-memory model without and with metapatch; "
        "prints the totals; writes the table only when asked (--write, --output FILE)")

EPILOG = """One process per architecture and leg (unpatched: METAPATCH_DISABLE=all; patched: metapatch imported
first). Results are cached per (torch, transformers, accelerate) in ~/.cache/metapatch/sweep
($METAPATCH_SWEEP_CACHE): a rerun resumes; an architecture reruns when its tiny config (the shrinking
rules' output) or the harness changes, and its patched leg also when a patch module changes.
With --write (docs/sweep.md) or --output FILE, the table is rendered from the cache for every architecture
(those not run yet are listed); without them nothing is written but the cache.
The whole sweep (222 architectures on transformers 5.24, 444 legs of 7-8 s) takes about an hour on one idle core.

examples:
  nice -n 10 metapatch sweep --write           the whole sweep, resumable; writes docs/sweep.md
  metapatch sweep --sample                     the CI sample (6 architectures); writes nothing
  metapatch sweep --arch LlamaForCausalLM --arch T5ForConditionalGeneration --rerun
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--arch", action="append", default=[], metavar="CLASS",
                        help="only this model class (repeatable), e.g. LlamaForCausalLM")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N architectures")
    parser.add_argument("--sample", action="store_true", help="only the fixed CI sample (metapatch.sweep.SAMPLE)")
    parser.add_argument("--rerun", action="store_true", help="ignore cached results of the selected architectures")
    parser.add_argument("--timeout", type=float, default=300, metavar="SECONDS", help="per architecture and leg")
    parser.add_argument("--jobs", type=int, default=1, help="legs run at once (default 1)")
    parser.add_argument("--write", action="store_true",
                        help="write the table to docs/sweep.md of this source tree (the committed table)")
    parser.add_argument("--output", default=None, metavar="FILE", help="write the table to FILE")
    parser.add_argument("--stale-ok", action="store_true",
                        help="keep cached patched legs measured with other metapatch code (the table names "
                             "the code digests it shows)")
    parser.add_argument("--no-write", action="store_true", help=argparse.SUPPRESS)  # the default now


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from . import UsageError

    if args.no_write and (args.write or args.output):
        raise UsageError("--no-write contradicts --write/--output")
    if args.jobs < 1 or args.timeout <= 0 or (args.limit is not None and args.limit < 1):
        raise UsageError("--jobs and --limit must be at least 1, --timeout positive")
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        raise UsageError("the sweep builds every architecture of the installed transformers: install torch and "
                         "transformers (pip install 'metapatch[hf]')")
    from metapatch import sweep
    from metapatch.sweep import render, runner

    writing = bool(args.write or args.output)
    output = _output_path(args, sweep.REPO) if writing else None
    everything = sweep.architectures()
    archs = everything
    if args.sample:
        archs = [row for row in archs if row[0] in sweep.SAMPLE]
    if args.arch:
        known = {name for name, _ in everything}
        unknown = [name for name in args.arch if name not in known]
        if unknown:
            print(f"metapatch sweep: unknown architecture(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
        archs = [row for row in archs if row[0] in args.arch]
    if args.limit is not None:
        archs = archs[:args.limit]
    stack = sweep.versions()
    stack_dir = sweep.cache_root() / sweep.stack_name(stack)
    stamp_all = sweep.cache_keys()
    shown = everything if writing else archs  # a written table covers every architecture
    stamp = {arch: sweep.arch_keys(stamp_all, model_type) for arch, model_type in shown}
    keys = {arch: dict(arch_stamp) for arch, arch_stamp in stamp.items()}
    if args.stale_ok:
        for arch_keys in keys.values():  # any metapatch code, this harness and config
            arch_keys["patched"] = arch_keys["patched"].split("-")[0] + "*"
    if args.rerun:
        for arch, _ in archs:
            for leg in sweep.LEGS:
                runner.result_path(stack_dir, arch, leg).unlink(missing_ok=True)
    started = time.perf_counter()
    runner.run_all(archs, keys, stack_dir, args.timeout, args.jobs,
                   log=lambda line: print(line, file=sys.stderr, flush=True), stamp=stamp)
    results = {(arch, leg): runner.load(stack_dir, arch, leg, keys[arch][leg]) for arch, _ in shown for leg in sweep.LEGS}
    total = sum(r.get("wall_s", 0) for r in results.values() if r)
    summary = render.summarize(shown, results)
    print(render.counts_line(summary))
    print(render.flows_line(summary))
    print(f"run now: {time.perf_counter() - started:.0f} s; sum of per-leg wall times: {total:.0f} s")
    if output is not None:
        command = ("metapatch sweep --write" if args.write else f"metapatch sweep --output {output.name}") + (
            " --sample" if args.sample else "")
        output.write_text(render.markdown(shown, results, stack, command, total))
        print(f"wrote {output}", file=sys.stderr)
    return 1 if render.regressions(summary) else 0


def _output_path(args: argparse.Namespace, repo):
    """Where the table goes, checked before hours of measuring: a file in an existing folder."""
    from pathlib import Path

    from . import UsageError

    output = Path(args.output) if args.output else Path(repo) / "docs" / "sweep.md"
    if output.is_dir():
        raise UsageError(f"--output {output} is a folder; name a file")
    if not output.parent.is_dir():
        raise UsageError(f"cannot write {output}: {output.parent} does not exist"
                         + ("" if args.output else " (--write needs a source checkout; use --output FILE)"))
    return output
