"""`metapatch pr` against a git repository built from a real released sdist (packaging's, from
PyPI, cached), and `metapatch pins` on synthetic distributions and on the real environment."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import metapatch
from metapatch import Patch, Target, Upstream, diffs, tested_versions
from metapatch._framework.registry import Registry
from metapatch.cli import main as cli_main
from metapatch.commands import pins

ROOT = Path(__file__).resolve().parents[1]
PATCH_ID = "mp-fake-fix"
BRANCH = f"metapatch/{PATCH_ID}"
TARGET_FILE = "src/packaging/utils.py"
ANCHOR = "def canonicalize_name("
INSERTED = "# metapatch regression marker: the fix goes here\n"
TEST_FILE = "tests/test_metapatch_regression.py"
TEST_SOURCE = "def test_canonicalize_name_regression():\n    from packaging.utils import canonicalize_name\n" \
              "    assert canonicalize_name('A_B') == 'a-b'\n"
GIT_ENV = {"GIT_AUTHOR_NAME": "metapatch tests", "GIT_AUTHOR_EMAIL": "tests@metapatch.invalid",
           "GIT_COMMITTER_NAME": "metapatch tests", "GIT_COMMITTER_EMAIL": "tests@metapatch.invalid",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
SELFTEST_SOURCE = '''\
from metapatch.selftest import Scenario
from packaging.utils import canonicalize_name as canon

PATCH_ID = "mp-fake-fix"
NAME = "A_B"


def _expected():
    return "a-b"


def reproduce_fake(workdir):
    \"\"\"Shows the bug.\"\"\"
    assert canon(NAME) == _expected()
    return {"max_abs_diff": 0.0}


def unrelated_helper():
    return "not part of the reproducer"


def slow_variant(workdir):
    return {}


SCENARIOS = [
    Scenario(PATCH_ID, "slow", f"{__name__}:slow_variant", "a slow one", expected_error="ValueError",
             in_selftest=False),
    Scenario(PATCH_ID, "basic", f"{__name__}:reproduce_fake", "shows it", expected_error="AssertionError"),
    Scenario("another-patch", "other", f"{__name__}:unrelated_helper", "not ours"),
]
'''


def git(repo: Path, *args: str, check: bool = True) -> str:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                            env={**os.environ, **GIT_ENV})
    if check:
        assert result.returncode == 0, result.stderr
    return result.stdout.strip()


# ---------------------------------------------------------------------------------------------
# The upstream clone: packaging's released sdist as a git repository


@pytest.fixture(scope="session")
def packaging_sdist(request, tmp_path_factory) -> Path:
    version = importlib.metadata.version("packaging")
    cache = request.config.cache.mkdir("metapatch-sdists") if getattr(request.config, "cache", None) is not None \
        else tmp_path_factory.mktemp("sdists")
    found = sorted(Path(cache).glob(f"packaging-{version}.tar.gz"))
    if found:
        return found[0]
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           "--disable-pip-version-check", "-q", "-d", str(cache), f"packaging=={version}"],
                          capture_output=True, text=True, timeout=300)
    found = sorted(Path(cache).glob(f"packaging-{version}.tar.gz"))
    if proc.returncode != 0 or not found:
        pytest.skip(f"cannot download the packaging {version} sdist from PyPI (offline?): {proc.stderr[-500:]}")
    return found[0]


@pytest.fixture
def clone(packaging_sdist, tmp_path) -> Path:
    with tarfile.open(packaging_sdist) as archive:
        archive.extractall(tmp_path / "extract")
    [top] = (tmp_path / "extract").iterdir()
    repo = tmp_path / "packaging"
    shutil.move(str(top), str(repo))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "packaging sdist")
    return repo


def fixed_source(original: str) -> str:
    assert original.count(ANCHOR) == 1
    return original.replace(ANCHOR, INSERTED + ANCHOR)


def unified(path: str, old: str, new: str) -> str:
    body = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        "/dev/null" if not old else f"a/{path}", f"b/{path}"))
    return f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if not old else "") + body


HEADER = ("Description: Mark where canonicalize_name gets fixed\n"
          " canonicalize_name needs a marker for the metapatch test.\n"
          " .\n"
          " It is only a comment.\n"
          "Origin: metapatch, metapatch/patches/mp_fake_fix.py\n"
          "Bug: https://example.invalid/packaging/issues/1\n"
          "Forwarded: no\n"
          "Last-Update: 2026-11-29\n"
          "---\n")


@pytest.fixture
def setup_patch(tmp_path, monkeypatch):
    """Register a fake patch (its diff under METAPATCH_DIFFS_ROOT, its selftest module on sys.path)."""
    root = tmp_path / "upstream_diffs"
    monkeypatch.setenv("METAPATCH_DIFFS_ROOT", str(root))
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "mp_fake_selftest.py").write_text(SELFTEST_SOURCE)
    monkeypatch.syspath_prepend(str(modules))
    importlib.invalidate_caches()

    def make(diff_text: str, affects=None, others=None) -> Path:
        diff = root / PATCH_ID / "packaging.diff"
        diff.parent.mkdir(parents=True, exist_ok=True)
        diff.write_text(diff_text)
        for package, text in (others or {}).items():
            (root / PATCH_ID / f"{package}.diff").write_text(text)
        patch = Patch(id=PATCH_ID, title="fake packaging fix", affects=affects or {"packaging": ">=1"},
                      targets=(Target("mp_never_imported.utils", "canonicalize_name", fingerprints=("0" * 16,),
                                      wrapper=lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)),),
                      upstream=Upstream(bug=("https://example.invalid/packaging/issues/1",)),
                      diffs=tuple(f"upstream_diffs/{PATCH_ID}/{name}.diff" for name in sorted(["packaging", *(others or {})])),
                      selftest="mp_fake_selftest")
        registry = Registry([patch])
        monkeypatch.setattr(metapatch, "registry", registry)
        return diff
    yield make
    sys.modules.pop("mp_fake_selftest", None)  # each test writes its own copy


def default_diff(repo: Path) -> str:
    original = (repo / TARGET_FILE).read_text()
    return HEADER + unified(TARGET_FILE, original, fixed_source(original)) + unified(TEST_FILE, "", TEST_SOURCE)


def run_pr(capsys, repo: Path, *extra: str):
    # The git mechanics only: upstream tests, regression tests and linters are tests/test_pr_checks.py's.
    code = cli_main(["pr", PATCH_ID, "--repo", str(repo), "--skip-tests", "--skip-lint", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def snapshot(repo: Path):
    return (git(repo, "rev-parse", "HEAD"), git(repo, "branch", "--list", "--format=%(refname:short)"),
            git(repo, "status", "--porcelain"))


# ---------------------------------------------------------------------------------------------
# metapatch pr


def test_pr_commits_the_diff_on_a_new_branch_and_writes_the_body(clone, setup_patch, capsys, monkeypatch):
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    original = (clone / TARGET_FILE).read_text()
    diff = setup_patch(default_diff(clone))
    diff_hash, cwd, main_before = hashlib.sha256(diff.read_bytes()).hexdigest(), os.getcwd(), git(clone, "rev-parse", "main")

    code, out, err = run_pr(capsys, clone)
    assert code == 0, err
    assert git(clone, "symbolic-ref", "--short", "HEAD") == BRANCH
    assert git(clone, "rev-parse", "main") == main_before  # the base is untouched
    assert git(clone, "rev-parse", f"{BRANCH}^") == main_before
    assert git(clone, "status", "--porcelain") == ""
    assert git(clone, "log", "-1", "--format=%B") == ("Mark where canonicalize_name gets fixed\n\n"
                                                      "canonicalize_name needs a marker for the metapatch test.\n\n"
                                                      "It is only a comment.")
    assert set(git(clone, "diff", "--name-only", "main", BRANCH).splitlines()) == {TARGET_FILE, TEST_FILE}
    assert git(clone, "show", f"{BRANCH}:{TARGET_FILE}") + "\n" == fixed_source(original)
    assert git(clone, "show", f"{BRANCH}:{TEST_FILE}") + "\n" == TEST_SOURCE
    assert hashlib.sha256(diff.read_bytes()).hexdigest() == diff_hash and os.getcwd() == cwd

    command = next(line.strip() for line in out.splitlines() if "gh pr create" in line)
    words = shlex.split(command.split("&&", 1)[1])
    assert words[:3] == ["gh", "pr", "create"]
    options = dict(zip(words[3::2], words[4::2]))
    assert options["--base"] == "main" and options["--head"] == BRANCH
    assert options["--title"] == "Mark where canonicalize_name gets fixed"
    body_file = Path(options["--body-file"])
    assert body_file.parent.parent == Path(git(clone, "rev-parse", "--absolute-git-dir"))  # inside .git
    body = body_file.read_text()
    for heading in ("## Problem", "## Minimal reproducer", "## Fix", "## Test"):
        assert heading in body
    problem = body.split("## Minimal reproducer")[0]
    assert "needs a marker for the metapatch test" in problem and "https://example.invalid/packaging/issues/1" in problem
    reproducer = body.split("## Minimal reproducer")[1].split("## Fix")[0]
    code_block = reproducer.split("```python\n")[1].split("```")[0]
    assert code_block.startswith("from packaging.utils import canonicalize_name as canon\n")
    for needed in ('NAME = "A_B"', "def _expected():", "def reproduce_fake(workdir):"):
        assert needed in code_block
    for unneeded in ("unrelated_helper", "slow_variant", "PATCH_ID", "Scenario"):
        assert unneeded not in code_block
    namespace = {}
    exec(compile(code_block, "reproducer", "exec"), namespace)  # self-contained: it runs as printed
    assert namespace["reproduce_fake"](None) == {"max_abs_diff": 0.0}
    # The body names the scenario it shows (not another scenario of the patch).
    assert "`reproduce_fake` from `mp_fake_selftest`: shows it. Without the fix it raises `AssertionError`." in reproducer
    assert "- `slow_variant`: a slow one. Without the fix it raises `ValueError`." in reproducer
    assert "not ours" not in reproducer
    assert f"{TEST_FILE}::test_canonicalize_name_regression" in body.split("## Test")[1]
    assert f"`{TARGET_FILE}`" in body.split("## Fix")[1]


def test_pr_merges_three_way_where_plain_apply_fails(clone, setup_patch, capsys, monkeypatch):
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    # A diff with blob ids, as `git diff` writes it, then upstream edits a context line of it.
    original = (clone / TARGET_FILE).read_text()
    (clone / TARGET_FILE).write_text(fixed_source(original))
    diff_text = HEADER + git(clone, "diff") + "\n"
    git(clone, "checkout", "-q", "--", TARGET_FILE)
    lines = original.splitlines(True)
    anchor = next(i for i, line in enumerate(lines) if line.startswith(ANCHOR))
    lines[anchor - 3] = lines[anchor - 3].rstrip("\n") + "  # edited upstream\n"
    (clone / TARGET_FILE).write_text("".join(lines))
    git(clone, "commit", "-q", "-am", "upstream moves on")
    diff = setup_patch(diff_text)
    plain = subprocess.run(["git", "-C", str(clone), "apply", "--check", str(diff)], capture_output=True)
    assert plain.returncode != 0  # only a three-way merge can apply it

    code, out, err = run_pr(capsys, clone)
    assert code == 0, err
    merged = git(clone, "show", f"{BRANCH}:{TARGET_FILE}") + "\n"
    assert merged == fixed_source("".join(lines))  # both upstream's edit and the fix


def test_pr_picks_the_diff_for_this_clone_among_several(clone, setup_patch, capsys, monkeypatch):
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    accelerate = HEADER + unified("src/accelerate/hooks.py", "x = 1\n", "x = 2\n")
    setup_patch(default_diff(clone), others={"accelerate": accelerate})
    before = snapshot(clone)
    code, _, err = run_pr(capsys, clone, "--package", "accelerate")
    assert code == 2 and "wrong repository" in err and "src/accelerate/hooks.py" in err
    assert snapshot(clone) == before
    code, _, err = run_pr(capsys, clone)
    assert code == 0, err
    assert set(git(clone, "diff", "--name-only", "main", BRANCH).splitlines()) == {TARGET_FILE, TEST_FILE}


def test_pr_refuses_a_dirty_tree(clone, setup_patch, capsys):
    setup_patch(default_diff(clone))
    (clone / "README.rst").write_text("local edit\n")
    before = snapshot(clone)
    code, _, err = run_pr(capsys, clone)
    assert code == 1 and "refused" in err and "uncommitted changes" in err and "README.rst" in err
    assert snapshot(clone) == before and (clone / "README.rst").read_text() == "local edit\n"


def test_pr_refuses_the_wrong_repository(tmp_path, clone, setup_patch, capsys):
    setup_patch(default_diff(clone))
    other = tmp_path / "other"
    other.mkdir()
    (other / "pyproject.toml").write_text('[project]\nname = "not-packaging"\nversion = "1"\n')
    git(other, "init", "-q", "-b", "main")
    git(other, "add", "-A")
    git(other, "commit", "-q", "-m", "other project")
    before = snapshot(other)
    code, _, err = run_pr(capsys, other)
    assert code == 2 and "wrong repository" in err and "not-packaging" in err and TARGET_FILE in err
    assert snapshot(other) == before
    # Right files, wrong project name: still refused.
    (clone / "pyproject.toml").write_text((clone / "pyproject.toml").read_text().replace(
        'name = "packaging"', 'name = "packaging-fork"'))
    git(clone, "commit", "-q", "-am", "renamed")
    code, _, err = run_pr(capsys, clone)
    assert code == 2 and "packaging-fork" in err


def test_pr_refuses_a_diff_that_does_not_apply(clone, setup_patch, capsys):
    diff_text = default_diff(clone)
    setup_patch(diff_text)
    source = (clone / TARGET_FILE).read_text()
    (clone / TARGET_FILE).write_text(source.replace(ANCHOR, "def canonicalise_name_renamed("))
    git(clone, "commit", "-q", "-am", "upstream renamed it")
    before = snapshot(clone)
    code, _, err = run_pr(capsys, clone)
    assert code == 1 and "does not apply" in err and TARGET_FILE in err
    assert snapshot(clone) == before


def test_pr_refuses_non_repositories_existing_branches_and_unknown_ids(tmp_path, clone, setup_patch, capsys):
    setup_patch(default_diff(clone))
    code, _, err = run_pr(capsys, tmp_path / "nowhere")
    assert code == 2 and "not a directory" in err  # bad input
    (tmp_path / "plain").mkdir()
    code, _, err = run_pr(capsys, tmp_path / "plain")
    assert code == 2 and "not a git repository" in err
    git(clone, "branch", BRANCH)
    before = snapshot(clone)
    code, _, err = run_pr(capsys, clone)
    assert code == 1 and "already exists" in err and snapshot(clone) == before
    assert cli_main(["pr", "no-such-patch", "--repo", str(clone)]) == 2
    assert "unknown patch id" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# metapatch pins


@pytest.fixture
def fake_dists(tmp_path, monkeypatch):
    """Install metadata-only distributions ``name==version`` first on sys.path."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))

    def install(**versions: str) -> None:
        for name, version in versions.items():
            info = site / f"{name.replace('-', '_')}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        importlib.invalidate_caches()
    return install


def record(patch_id: str, affects: dict, diffs=()) -> Patch:
    return Patch(id=patch_id, title=patch_id, affects=affects,
                 targets=(Target("mp_never_imported.mod", "f", fingerprints=("0" * 16,),
                                 wrapper=lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)),),
                 diffs=tuple(diffs))


MATRIX = ({"mpa": "1.0", "mpb": "2.0", "mpc": "3.0", "mpd": "4.0"},
          {"mpa": "1.1", "mpb": "2.0", "mpc": "3.0", "mpd": "4.0"})


def test_pins_pins_tested_versions_and_drops_what_no_patch_needs(fake_dists, monkeypatch):
    fake_dists(mpa="1.1", mpb="2.0+local", mpc="3.5")  # mpd is not installed
    registry = Registry([
        record("fixed-in-mpa", {"mpa": "<1.1"}),                      # not-affected at mpa 1.1
        record("needs-mpb", {"mpb": ">=2"}),                           # in range: mpb pin stays
        record("via-diff", {"mpa": "<1.1"}, ["upstream_diffs/via-diff/mpb.diff"]),  # belongs to mpb too
    ])
    registry.install()
    report = pins.compute(registry, MATRIX, diffs.installed_version)
    by = {e["distribution"]: e for e in report["entries"]}
    assert by["mpa"]["pin"] == "mpa==1.1" and by["mpa"]["droppable"]
    assert by["mpa"]["patches"] == ["fixed-in-mpa", "via-diff"]
    assert by["mpb"]["pin"] == "mpb==2.0" and not by["mpb"]["droppable"]  # local label: public pin
    assert by["mpb"]["patches"] == ["needs-mpb", "via-diff"]
    assert by["mpc"]["pin"] is None and "not a version metapatch has been tested with" in by["mpc"]["why"]
    assert not by["mpc"]["droppable"]  # no patch belongs to it: nothing says the bug is gone
    assert by["mpd"]["installed"] is None and by["mpd"]["pin"] is None
    assert report["combination_tested"] is False

    monkeypatch.setattr(metapatch, "registry", registry)
    monkeypatch.setattr(tested_versions, "MATRIX", MATRIX)
    text = pins.format_report(report)
    lines = text.splitlines()
    assert "mpb==2.0" in lines and "mpa==1.1" not in lines
    assert "# mpa==1.1  (fixed-in-mpa, via-diff)" in lines
    assert any(line.startswith("# mpc==3.5 is installed") and "3.0" in line for line in lines)
    assert any(line.startswith("# mpd: not installed") for line in lines)


def test_pins_combination_tested_when_installed_matches_a_row(fake_dists):
    fake_dists(mpa="1.0", mpb="2.0", mpc="3.0", mpd="4.0")
    registry = Registry([])
    report = pins.compute(registry, MATRIX, diffs.installed_version)
    assert report["combination_tested"] is True
    assert [e["pin"] for e in report["entries"]] == ["mpa==1.0", "mpb==2.0", "mpc==3.0", "mpd==4.0"]
    assert "not a tested one" not in pins.format_report(report)


def test_tested_versions_is_the_documented_matrix():
    pairs = {(row["transformers"], row["accelerate"]) for row in tested_versions.MATRIX}
    assert pairs == {("5.11.0", "1.13.0"), ("5.7.0", "1.13.0"), ("5.25.0", "1.16.0")}
    for row in tested_versions.MATRIX:
        assert (row["torch"], row["peft"], row["bitsandbytes"]) == ("2.13.0", "0.22.0", "0.50.2")
    # nox's `latest` environment is the newest pair; the pair before it stays covered by a gate stack
    noxfile = (ROOT / "noxfile.py").read_text()
    assert '("5.25.0", "1.16.0"): "latest"' in noxfile
    previous = {(s["transformers"], s["accelerate"]) for s in tested_versions.GATE_STACKS.values()}
    assert ("5.24.0", "1.15.0") in previous
    assert "0.21.2" in {s["peft"] for s in tested_versions.GATE_STACKS.values()}  # the peft before the latest too


def test_pins_command_on_the_real_environment():
    from packaging.version import Version

    env = {k: v for k, v in os.environ.items() if k not in ("METAPATCH_DIFFS_ROOT", "METAPATCH_DISABLE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = lambda *a: subprocess.run([sys.executable, "-m", "metapatch", *a], env=env, capture_output=True,
                                    text=True, timeout=300)
    text = run("pins")
    assert text.returncode == 0, text.stderr
    status = json.loads(run("status", "--json").stdout)
    lines = text.stdout.splitlines()
    for dist in tested_versions.MATRIX[0]:
        tested = {row[dist] for row in tested_versions.MATRIX}
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            assert any(line.startswith(f"# {dist}: not installed") for line in lines)
            continue
        public = Version(installed).public
        owners = [r for r in status if dist in r["affects"] or any(Path(d).stem == dist for d in r["diffs"])]
        droppable = bool(owners) and all(r["state"] == "not-affected" for r in owners)
        if public not in tested:
            assert any(line.startswith(f"# {dist}=={installed} is installed") for line in lines)
        elif droppable:
            assert any(line.startswith(f"# {dist}=={public}  (") for line in lines), text.stdout
        else:
            assert f"{dist}=={public}" in lines, text.stdout
