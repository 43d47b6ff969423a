"""A CPU-runnable copy of peft's own offload tests, generated from the installed peft's sdist.

peft tests cpu/disk offloading in ``tests/test_gpu_examples.py`` (class ``TestOffloadSave``; called
``OffloadSaveTests`` up to 0.17). That module skips itself on CPU-only machines, imports ``datasets``
and downloads ``gpt2`` / ``peft-internal-testing/opt-125m`` from the hub, so on metapatch's CI it
proves nothing. ``build_suite`` parses that module with ``ast``, takes only the offload class and
the imports it uses, and rewrites it (nothing of peft is stored in this repository):

* hub model ids -> tiny random checkpoints of the same architectures (``GPT2LMHeadModel``,
  ``OPTForCausalLM``) saved locally;
* memory limits ("0.4GIB" ...) -> the same fraction of the tiny checkpoint's size as of the real
  one's (sizes below), so the tests' own asserts that the model is split between cpu and disk still
  hold and still check it;
* GPU index keys (``{0: a, "cpu": b}``) -> one "cpu" budget of a + b, and ``0 in device_map.values()``
  -> ``"cpu" in ...``: what upstream keeps in accelerator memory stays in memory, the disk part
  stays on disk (``single_gpu_tests`` only; anything else that names an accelerator is left out);
* ``torch.allclose(a, b)`` without tolerances -> ``atol=1e-5`` (the class's other comparisons use
  it): the tiny model's logits are ~0.5, not ~-100 like gpt2's, so the default rtol no longer covers
  float32 rounding of a merge (2e-7), while a lost adapter still shows (its effect is ~0.5);
* ``hub_online_once(...)`` -> ``contextlib.nullcontext()``; ``AutoTokenizer.from_pretrained(...)``
  -> fixed input ids (the prompt's bytes);
* GPU-only decorators (``require_non_cpu``, ``pytest.mark.single_gpu_tests``) dropped; a test with
  any other decorator is left out, with the reason.

Every other peft test with "offload" in its name is listed with the reason it is not CPU-runnable.

The copy runs under peft's own pytest settings (``markers``, ``filterwarnings`` from its pyproject),
written to a ``pytest.ini`` next to it: peft <= 0.17 has both ``[tool.pytest]`` and
``[tool.pytest.ini_options]``, which pytest >= 9 refuses to read, and its ``addopts`` need pytest-cov.

Limits of a CPU copy: upstream's accelerator share runs in cpu memory, so the modules upstream
offloads to cpu (hooks with a cpu weights map) are plain cpu modules here; disk offload keeps its
hooks and its offload folder, as upstream.
"""

from __future__ import annotations

import ast
import builtins
import copy
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set

# The offload classes' names across peft releases.
OFFLOAD_CLASSES = ("TestOffloadSave", "OffloadSaveTests")
SOURCE = "tests/test_gpu_examples.py"

# Parameter counts of the real hub checkpoints (tied embeddings counted once), for rescaling.
REAL_PARAMETERS = {"gpt2": 124_439_808, "peft-internal-testing/opt-125m": 125_239_296}

# Same layout as the real models (12 blocks, embeddings ~30% of the weights), so the split between
# cpu and disk falls at the same place; vocab >= 256 so the prompt's bytes are valid token ids.
TINY_CONFIGS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=1000, n_embd=32, n_layer=12, n_head=4, n_positions=64,
                  bos_token_id=0, eos_token_id=0)),
    "peft-internal-testing/opt-125m": ("OPTConfig", "OPTForCausalLM",
                                       dict(vocab_size=1000, hidden_size=32, word_embed_proj_dim=32,
                                            ffn_dim=128, num_hidden_layers=12, num_attention_heads=4,
                                            max_position_embeddings=64)),
}

# Other offload tests in peft's suite and why they have no CPU copy.
NOT_CPU_RUNNABLE = {
    "test_dora_ephemeral_gpu_offload":
        "ephemeral GPU offload moves DoRA's computation onto an accelerator; on CPU there is none to move to",
    "test_dora_ephemeral_gpu_offload_multigpu": "needs two accelerators (moves lora_A/lora_B between them)",
    "test_frod_runtime_offload_keeps_base_weight_on_cpu_after_accelerator_move":
        "checks that the base weight stays on cpu when the model moves to an accelerator; vacuous with cpu",
    "test_frod_mixing_runtime_offload_base_weight_raises":
        "already a CPU test (FRoD config validation, no device map); nothing metapatch patches",
}

DROPPED_DECORATORS = {"require_non_cpu", "pytest.mark.single_gpu_tests"}
ACCELERATOR_NAMES = {"torch_device", "device_count", "infer_device", "get_backend", "is_xpu_available"}
ACCELERATOR_STRINGS = re.compile(r"^(cuda|xpu|mps|npu|hpu)(:\d+)?$")
MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GIB|MIB|KIB|GB|MB|KB)\s*$", re.IGNORECASE)
UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}

TOKENIZER_STUB = '''
class _FixedIdsTokenizer:
    """Stands in for the hub tokenizer: the prompt's bytes are the input ids (tiny vocab >= 256)."""

    def encode(self, text, return_tensors=None):
        import torch

        return torch.tensor([list(text.encode("utf-8"))])
'''

CONFTEST = '''
"""Records whether metapatch was imported in this run and which patches it applied."""
import json
import os
import sys


def pytest_sessionfinish(session, exitstatus):
    metapatch = sys.modules.get("metapatch")
    applied = [row["id"] for row in metapatch.status() if row["state"] == "applied"] if metapatch else []
    with open(os.environ["PEFT_OFFLOAD_SUITE_STATE"], "w") as handle:
        json.dump({"imported": metapatch is not None, "applied": applied}, handle)
'''


class RewriteError(Exception):
    """peft's offload tests changed shape: the rewrite must be updated, not silently skipped."""


@dataclass
class GeneratedSuite:
    path: Path
    source_class: str
    tests: List[str]                      # generated test ids, as pytest names them
    left_out: Dict[str, str]              # upstream test -> why it has no CPU copy
    notes: List[str] = field(default_factory=list)  # rescaled limits and other rewrites


def _pytest_ini(sdist_root: Path) -> str:
    """peft's markers and filterwarnings as a pytest.ini (native table first, ini_options over it)."""
    tables = tomllib.loads((sdist_root / "pyproject.toml").read_text()).get("tool", {}).get("pytest", {})
    settings = {**{k: v for k, v in tables.items() if k != "ini_options"}, **tables.get("ini_options", {})}
    lines = ["[pytest]"]
    for key in ("markers", "filterwarnings"):
        values = settings.get(key, [])
        values = values.splitlines() if isinstance(values, str) else values
        lines += [f"{key} ="] + [f"    {v.strip()}" for v in values if v.strip()]
    return "\n".join(lines) + "\n"


def save_tiny_checkpoints(dest: Path) -> Dict[str, tuple]:
    """hub id -> (local path, bytes of the tiny model's weights). Seeded: both runs load the same."""
    import torch
    import transformers

    saved = {}
    for index, (hub_id, (config_name, model_name, values)) in enumerate(TINY_CONFIGS.items()):
        torch.manual_seed(index)
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**values)).eval()
        path = dest / hub_id.replace("/", "--")
        model.save_pretrained(path)
        size = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
        saved[hub_id] = (path, size)
    return saved


def _memory_bytes(text: str) -> Optional[float]:
    match = MEMORY.match(text) if isinstance(text, str) else None
    return float(match.group(1)) * UNITS[match.group(2).upper()] if match else None


def _decorator_name(node: ast.expr) -> str:
    return ast.unparse(node.func if isinstance(node, ast.Call) else node)


def _hub_ids_in(node: ast.AST, attributes: Dict[str, str]) -> Set[str]:
    found = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Constant) and child.value in REAL_PARAMETERS:
            found.add(child.value)
        elif (isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name)
              and child.value.id == "self" and child.attr in attributes):
            found.add(attributes[child.attr])
    return found


def _model_attributes(cls: ast.ClassDef) -> Dict[str, str]:
    """``causal_lm_model_id = "gpt2"`` in the class body or ``self.x = "gpt2"`` in setUp."""
    attributes = {}
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and getattr(node.value, "value", None) in REAL_PARAMETERS:
            for target in node.targets:
                name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
                if name:
                    attributes[name] = node.value.value
    return attributes


def _accelerator_use(node: ast.AST) -> Optional[str]:
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and child.id in ACCELERATOR_NAMES:
            return f"uses {child.id}"
        if isinstance(child, ast.Attribute) and child.attr in {"cuda", "xpu"}:
            return f"uses .{child.attr}"
        if isinstance(child, ast.Constant) and isinstance(child.value, str) and ACCELERATOR_STRINGS.match(child.value):
            return f"names device {child.value!r}"
    return None


class _Rewrite(ast.NodeTransformer):
    """Applies the rewrites listed in the module docstring to one test method."""

    def __init__(self, checkpoints: Dict[str, tuple], hub_id: Optional[str], notes: List[str], test: str):
        self.checkpoints, self.hub_id, self.notes, self.test = checkpoints, hub_id, notes, test

    def _scaled(self, node: ast.expr) -> ast.expr:
        size = _memory_bytes(node.value) if isinstance(node, ast.Constant) else None
        if size is None:
            return node
        if self.hub_id is None:
            raise RewriteError(f"{self.test}: memory limit {node.value!r} but no single hub model to scale it by")
        scaled = int(size * self.checkpoints[self.hub_id][1] / (REAL_PARAMETERS[self.hub_id] * 4))
        return ast.Constant(scaled)

    def visit_Dict(self, node: ast.Dict) -> ast.expr:
        self.generic_visit(node)
        keys = [k.value if isinstance(k, ast.Constant) else k for k in node.keys]
        if not any(isinstance(k, int) or k in ("cpu", "disk") for k in keys):
            return node
        before = ast.unparse(node)
        merged: Dict[str, ast.expr] = {}
        for key, value in zip(keys, node.values):
            key = "cpu" if isinstance(key, int) and not isinstance(key, bool) else key
            value = self._scaled(value)
            if key in merged:  # a GPU budget joins the cpu one: it was in memory upstream, stays in memory
                if not (isinstance(merged[key], ast.Constant) and isinstance(value, ast.Constant)):
                    raise RewriteError(f"{self.test}: cannot merge memory limits in {before}")
                value = ast.Constant(merged[key].value + value.value)
            merged[key] = value
        rewritten = ast.Dict(keys=[ast.Constant(k) for k in merged], values=list(merged.values()))
        self.notes.append(f"{self.test}: {before} -> {ast.unparse(rewritten)}")
        return rewritten

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        self.generic_visit(node)
        left = node.left
        if (isinstance(left, ast.Constant) and isinstance(left.value, int) and not isinstance(left.value, bool)
                and isinstance(node.ops[0], (ast.In, ast.NotIn))):
            node.left = ast.Constant("cpu")  # `0 in device_map.values()`: the accelerator's share is on cpu now
        return node

    def visit_Call(self, node: ast.Call) -> ast.expr:
        self.generic_visit(node)
        name = ast.unparse(node.func)
        if name == "hub_online_once":
            return ast.Call(func=ast.Name("nullcontext", ast.Load()), args=[], keywords=[])
        if name == "AutoTokenizer.from_pretrained":
            return ast.Call(func=ast.Name("_FixedIdsTokenizer", ast.Load()), args=[], keywords=[])
        if name == "torch.allclose" and not {k.arg for k in node.keywords} & {"atol", "rtol"}:
            # gpt2's logits are ~-100, so the default rtol=1e-5 absorbs float32 rounding of a merge;
            # a tiny random model's are ~0.5 (merge rounding 2e-7 > 1e-8 + 1e-5 * 0.5 near zero).
            # 1e-5 is the atol of the class's other comparisons; the adapter's effect is ~0.5.
            node.keywords.append(ast.keyword("atol", ast.Constant(1e-5)))
            self.notes.append(f"{self.test}: {ast.unparse(node)} (atol added)")
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.expr:
        if node.value in self.checkpoints:
            return ast.Constant(str(self.checkpoints[node.value][0]))
        return node


def _offload_tests_elsewhere(sdist_root: Path, source_class: str) -> List[str]:
    """Test functions with "offload" in their names outside the rewritten class."""
    found = []
    for path in sorted((sdist_root / "tests").glob("test_*.py")):
        text = path.read_text()
        if "offload" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name == source_class and path.name == Path(SOURCE).name:
                continue
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef) and child.name.startswith("test") and "offload" in child.name:
                    owner = f"{node.name}::" if isinstance(node, ast.ClassDef) else ""
                    found.append(f"{path.relative_to(sdist_root)}::{owner}{child.name}")
    return sorted(set(found))


def _imports_for(module: ast.Module, used: Set[str]) -> List[ast.stmt]:
    kept = []
    for node in module.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used]
            if names:
                if isinstance(node, ast.ImportFrom) and node.level:
                    raise RewriteError(f"still needs {[a.name for a in names]} from peft's tests/{node.module}")
                clone = copy.copy(node)
                clone.names = names
                kept.append(clone)
    return kept


def _names(node: ast.AST) -> tuple:
    loaded, bound = set(), set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            (loaded if isinstance(child.ctx, ast.Load) else bound).add(child.id)
        elif isinstance(child, ast.arg):
            bound.add(child.arg)
        elif isinstance(child, (ast.FunctionDef, ast.ClassDef)):
            bound.add(child.name)
        elif isinstance(child, ast.alias):
            bound.add(child.asname or child.name.split(".")[0])
    return loaded, bound


def build_suite(sdist_root: Path, dest: Path, checkpoints: Dict[str, tuple], version: str) -> GeneratedSuite:
    module = ast.parse((sdist_root / SOURCE).read_text())
    classes = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name in OFFLOAD_CLASSES]
    if len(classes) != 1:
        raise RewriteError(f"peft {version}: expected one of {OFFLOAD_CLASSES} in {SOURCE}, found {len(classes)}")
    cls = copy.deepcopy(classes[0])
    attributes = _model_attributes(cls)
    left_out: Dict[str, str] = {}
    notes: List[str] = []
    body = []
    for node in cls.body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
            body.append(_Rewrite(checkpoints, None, notes, getattr(node, "name", cls.name)).visit(node))
            continue
        kept = [d for d in node.decorator_list if _decorator_name(d) not in DROPPED_DECORATORS]
        hub_ids = _hub_ids_in(node, attributes)
        reason = (f"decorated {', '.join(_decorator_name(d) for d in kept)}" if kept
                  else _accelerator_use(node) or (None if len(hub_ids) == 1 else f"uses hub models {sorted(hub_ids)}"))
        if reason:
            left_out[f"{SOURCE}::{cls.name}::{node.name}"] = reason
            continue
        node.decorator_list = []
        body.append(_Rewrite(checkpoints, hub_ids.pop(), notes, node.name).visit(node))
    cls.body = body
    cls.decorator_list = [d for d in cls.decorator_list if _decorator_name(d) not in DROPPED_DECORATORS]
    if cls.decorator_list:
        raise RewriteError(f"{cls.name} has decorators the rewrite does not know: "
                           f"{[_decorator_name(d) for d in cls.decorator_list]}")
    tests = [n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    if not tests:
        raise RewriteError(f"peft {version}: no CPU-runnable test left in {cls.name}: {left_out}")
    ast.fix_missing_locations(cls)

    stub = ast.parse(TOKENIZER_STUB)
    loaded, bound = _names(cls)
    imports = _imports_for(module, loaded)
    _, imported = _names(ast.Module(body=imports, type_ignores=[]))
    missing = loaded - bound - imported - set(dir(builtins)) - {"nullcontext", "_FixedIdsTokenizer"}
    if missing:
        raise RewriteError(f"the rewritten {cls.name} uses names with no import: {sorted(missing)}")
    for name in _offload_tests_elsewhere(sdist_root, cls.name):
        left_out[name] = NOT_CPU_RUNNABLE.get(name.rsplit("::", 1)[1], "not classified by tests/_peft_offload_suite.py")

    header = (f'"""Generated by metapatch tests/_peft_offload_suite.py from peft {version} sdist {SOURCE}::'
              f'{cls.name}; see that module for the rewrites."""\n')
    text = "\n\n".join([header + "from contextlib import nullcontext",
                        ast.unparse(ast.Module(body=imports, type_ignores=[])),
                        ast.unparse(stub), ast.unparse(cls)]) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "test_peft_offload_cpu.py"
    path.write_text(text)
    (dest / "conftest.py").write_text(CONFTEST)
    (dest / "pytest.ini").write_text(_pytest_ini(sdist_root))
    return GeneratedSuite(path, cls.name, [f"{cls.name}::{t}" for t in tests], left_out, notes)
