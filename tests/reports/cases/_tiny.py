"""Shared pieces of the report reproducers: tiny checkpoints cached for both legs of a run, the
in-memory reference, and the comparison. Imported only inside the child process (torch is heavy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict

import torch

from metapatch.selftest import NotApplicable
from metapatch.selftest._models import input_ids, max_abs_diff, save_tiny_llama, tiny_llama_config

__all__ = ["NotApplicable", "input_ids", "max_abs_diff", "tiny_llama_config"]

TOLERANCE = 1e-5

# Layers 2 and 3 on disk: on a machine without accelerators "cpu" entries are the execution device,
# so "disk" is what puts weights behind accelerate's offload hooks (a GPU machine behaves the same).
LLAMA_DISK_MAP = {
    "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
    "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "cpu",
}
# The first parameter (the embedding) on disk too: model.device becomes meta.
LLAMA_EMBEDDING_ON_DISK = dict(LLAMA_DISK_MAP, **{"model.embed_tokens": "disk"})


def shared(workdir: Path) -> Path:
    """A folder both legs of one run share (checkpoints are built once)."""
    path = workdir.parent / "shared"
    path.mkdir(exist_ok=True)
    return path


def cached(workdir: Path, name: str, build: Callable[[Path], Any]) -> Path:
    path = shared(workdir) / name
    if not (path / ".done").exists():
        build(path)
        (path / ".done").write_text("")
    return path


def llama(workdir: Path, tie: bool = False, **overrides: Any) -> Path:
    name = "llama-tied" if tie else "llama"
    if overrides:
        name += "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    return cached(workdir, name, lambda p: save_tiny_llama(p, tie_word_embeddings=tie, **overrides))


def save_random(cls: Any, config: Any, path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cls(config).eval().save_pretrained(path)
    return path


def offload(workdir: Path, name: str = "offload") -> str:
    return str(workdir / name)


def logits(model: Any, ids: Any = None, **kwargs: Any) -> Any:
    with torch.no_grad():
        return model(ids if ids is not None else input_ids(), **kwargs).logits


def greedy(model: Any, ids: Any = None, new_tokens: int = 4) -> Any:
    ids = ids if ids is not None else input_ids()
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)


def assert_matches(got: Any, want: Any, what: str, tolerance: float = TOLERANCE) -> float:
    """Raise when outputs differ from the in-memory reference (a silently wrong result is a bug)."""
    diff = max_abs_diff(got, want)
    if not diff <= tolerance:  # also catches NaN
        raise AssertionError(f"{what}: outputs differ from the in-memory reference by {diff}")
    return diff


def require(module: Any, name: str) -> Any:
    cls = getattr(module, name, None)
    if cls is None:
        raise NotApplicable(f"needs {name} (not in {module.__name__} {getattr(module, '__version__', '')})")
    return cls


def meta_names(model: Any) -> list:
    return [n for n, p in model.named_parameters() if p.is_meta]


def metrics(**values: Any) -> Dict[str, Any]:
    return {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
