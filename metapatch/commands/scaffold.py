"""metapatch scaffold"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

from . import UsageError

HELP = "start a new patch in a source checkout: its record, scenario module, test file and diff folder"

EPILOG = """example:
  metapatch scaffold accelerate-meta-buffers --target accelerate.hooks:AlignDevicesHook.pre_forward \\
      --affects accelerate='>=1.10.0' --title "accelerate's pre_forward keeps buffers on meta"

Writes, named by the id (the convention of metapatch._framework.layout):
  metapatch/patches/<mod>.py        the record (PATCH), with each target's fingerprint measured on the
                                    installed release, and a wrapper that calls upstream untouched
  metapatch/selftest/<mod>.py       SCENARIOS: one scenario whose function you write (it fails until you do)
  tests/patches/test_<mod>.py       the three-way test (unpatched, patched, the upstream diff alone)
  upstream_diffs/<id>/              where the upstream diff goes (<package>.diff with a DEP-3 header)
then regenerates the patch INDEX. Nothing is overwritten: an id that has any of these is refused.
tests/test_patch_pieces.py fails until the survey table (metapatch/survey/tables/<id>.json, written by
`metapatch survey <id>`) and the diff (or, for a bug fixed upstream, fixed_in) are there.
exit code: 0, or 2 for a bad id, target or range, an id that exists, or no source checkout.
"""

_ID = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)+$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("id", help="the new patch id: two or more lowercase words joined by '-', the package, model or "
                        "kind of bug first (accelerate-..., gemma4-..., offloaded-...)")
    parser.add_argument("--target", action="append", required=True, metavar="MODULE:QUALNAME",
                        help="an upstream object the patch wraps (repeatable); it must import here")
    parser.add_argument("--affects", action="append", required=True, metavar="DIST=SPEC",
                        help="a distribution and the range you measured the bug in, e.g. accelerate='>=1.10.0' (repeatable)")
    parser.add_argument("--title", default="", help="one line: what goes wrong upstream and what the patch does")
    parser.add_argument("--root", type=Path, default=None,
                        help="the source checkout to write into (default: the one this metapatch runs from)")


def _checkout(root: "Path | None") -> Path:
    if root is None:
        root = Path(__file__).resolve().parents[2]
    root = root.resolve()
    if not (root / "metapatch" / "patches").is_dir() or not (root / "tests" / "patches").is_dir():
        raise UsageError(f"{root}: not a metapatch source checkout (scaffold writes into metapatch/ and tests/); "
                         f"give --root")
    return root


def _affects(pairs: List[str]) -> Dict[str, str]:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    out: Dict[str, str] = {}
    for pair in pairs:
        dist, eq, spec = pair.partition("=")
        if not eq or not dist.strip() or not spec.strip():
            raise UsageError(f"--affects {pair!r} is not DIST=SPEC (e.g. accelerate='>=1.10.0')")
        try:
            SpecifierSet(spec.strip())
        except InvalidSpecifier:
            raise UsageError(f"--affects {pair!r}: {spec.strip()!r} is not a version range") from None
        out[dist.strip()] = spec.strip()
    return out


def _targets(dotted: List[str]) -> List[Tuple[str, str, str]]:
    """(module, qualname, fingerprint) of each target, measured on the installed release."""
    from metapatch._framework.registry import fingerprint

    from .fingerprint import target_object

    out = []
    for name in dotted:
        obj = target_object(name)
        try:
            value = fingerprint(obj)
        except (OSError, TypeError, SyntaxError) as exc:
            raise UsageError(f"{name}: cannot read its source ({exc})") from None
        module, _, qualname = name.partition(":")
        out.append((module, qualname, value))
    return out


def _release_of(module: str) -> str:
    """The distribution and release a target's source was read from ("accelerate 1.16.0")."""
    import sys
    from importlib.metadata import packages_distributions, version

    top = module.split(".")[0]
    dists = packages_distributions().get(top) or []
    if not dists:
        return f"Python {sys.version.split()[0]}"
    return f"{dists[0]} {version(dists[0])}"


def patch_source(patch_id: str, title: str, affects: Dict[str, str], targets: List[Tuple[str, str, str]]) -> str:
    wrappers, records = [], []
    for n, (module, qualname, value) in enumerate(targets):
        name = "_" + re.sub(r"\W", "_", qualname.split(".")[-1]).lstrip("_") + (f"_{n}" if len(targets) > 1 else "")
        wrappers.append("\n" + textwrap.dedent(f'''
            def {name}(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
                """{module}:{qualname}, where the bug needs it; upstream's own call everywhere else."""
                return wrapped(*args, **kwargs)
            '''))
        records.append(f'        # the source of {_release_of(module)}\n'
                       f'        Target("{module}", "{qualname}", fingerprints=("{value}",), wrapper={name}),')
    return (f'"""{patch_id}: {title or "what goes wrong upstream, and what the patch does"}.\n\n'
            "Say here what upstream does wrong and why this fix is the right one: the mechanism, the entry points\n"
            'that share it, and what the patch leaves to upstream.\n"""\n\n'
            "from __future__ import annotations\n\n"
            "from typing import Any, Callable, Dict, Tuple\n\n"
            "from metapatch._framework.records import Patch, Target, Upstream\n"
            + "".join(wrappers) + "\n\n"
            "PATCH = Patch(\n"
            f'    id="{patch_id}",\n'
            f"    title={json.dumps(title or 'the one line metapatch status prints')},\n"
            f"    # The range you measured the bug in: leave the upper end open until a release has the fix.\n"
            f"    affects={json.dumps(affects)},\n"
            "    targets=(\n" + "\n".join(records) + "\n    ),\n"
            '    upstream=Upstream(bug=(), forwarded="no", note=""),\n'
            ")\n")


def scenario_source(patch_id: str) -> str:
    return textwrap.dedent(f'''\
        """{patch_id}: the reproducer, run without and with metapatch by `metapatch selftest` and the tests."""

        from __future__ import annotations

        from pathlib import Path
        from typing import Any, Dict

        from metapatch.selftest._harness import Scenario


        def reproducer(workdir: Path) -> Dict[str, Any]:
            """Build a tiny model in ``workdir``, run the real path (a real ``from_pretrained`` with a cpu/disk
            ``device_map`` and ``offload_folder``, a real ``dispatch_model``, ...) on the execution device
            (metapatch.selftest._device), compare with the in-memory model and raise when they differ; return
            {{"max_abs_diff": ...}}."""
            raise NotImplementedError("{patch_id}: write the reproducer")


        SCENARIOS = [
            Scenario("{patch_id}", "reproducer", f"{{__name__}}:reproducer",
                     "what the scenario shows, in one line",
                     expected_error="", expected_message="", quick=True),
        ]
        ''')


def test_source(patch_id: str, stem: str) -> str:
    return textwrap.dedent(f'''\
        """{patch_id}: three-way proof on its scenarios (unpatched: upstream's error where affected; patched: the
        in-memory answer; the upstream diff alone: fixed)."""

        from __future__ import annotations

        from metapatch.patches.{stem} import PATCH

        from _three_way import ThreeWayCase  # tests/patches/_three_way.py


        class TestThreeWay(ThreeWayCase):
            patch_ids = (PATCH.id,)
        ''')


def run(args: argparse.Namespace) -> int:
    from metapatch._framework import layout

    if not _ID.match(args.id):
        raise UsageError(f"{args.id!r} is not a patch id: lowercase words joined by '-' (e.g. accelerate-meta-buffers)")
    root = _checkout(args.root)
    stem = layout.stem(args.id)
    files = {
        "record": root / "metapatch" / "patches" / f"{stem}.py",
        "scenarios": root / "metapatch" / "selftest" / f"{stem}.py",
        "test": root / "tests" / "patches" / f"test_{stem}.py",
        "diff folder": root / "upstream_diffs" / args.id,
    }
    existing = [str(path.relative_to(root)) for path in files.values() if path.exists()]
    if existing or (root / "metapatch" / "patches" / stem).is_dir():
        raise UsageError(f"{args.id}: exists already ({', '.join(existing) or f'metapatch/patches/{stem}/'})")
    affects = _affects(args.affects)
    targets = _targets(args.target)
    files["record"].write_text(patch_source(args.id, args.title, affects, targets))
    files["scenarios"].write_text(scenario_source(args.id))
    files["test"].write_text(test_source(args.id, stem))
    files["diff folder"].mkdir(parents=True)
    index = _write_index(root)
    for what, path in files.items():
        print(f"{what:12} {path.relative_to(root)}")
    print(f"{'index':12} {index}")
    print("next: write the reproducer and the fix, then upstream_diffs/"
          f"{args.id}/<package>.diff (DEP-3 header, Upstream-Base: the release it is written against) and "
          f"the survey table (metapatch survey {args.id} writes metapatch/survey/tables/{args.id}.json); "
          "pytest tests/patches/test_" + stem + ".py tests/test_patch_pieces.py")
    return 0


def _write_index(root: Path) -> str:
    """Regenerate the INDEX of ``root``'s metapatch/patches in a child interpreter: the new record is
    imported from that checkout, not from the metapatch this process runs."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p),
           "METAPATCH_DISABLE": "all"}
    done = subprocess.run([sys.executable, "-m", "metapatch.patches", "--write"], cwd=str(root), env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise UsageError(f"python -m metapatch.patches --write failed: {' '.join(done.stderr.split())[-300:]}")
    return done.stdout.strip() or "metapatch/patches/__init__.py: INDEX already up to date"
