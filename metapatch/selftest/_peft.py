"""Shared builders of the PEFT reproducers (``peft-offload-redispatch``,
``accelerate-dispatch-skip-keys``, the benchmarks): a tiny Gemma 4 with KV-shared layers, the
offload map, a non-zero LoRA adapter, and the side-effect watch (checkpoint hashes, the working
directory, the work directory outside the offload folders). Imported only inside scenario
functions: torch is heavy."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Dict, Optional

_NEW_TOKENS = 4


def require_gemma4() -> None:
    """Gemma 4 arrived in transformers 5.5.0: on older releases its scenarios are not applicable."""
    import transformers

    from . import NotApplicable

    if not hasattr(transformers, "Gemma4ForCausalLM"):
        raise NotApplicable(f"needs transformers >= 5.5 (Gemma4ForCausalLM); installed {transformers.__version__}")


def tiny_gemma4_config() -> Any:
    """A Gemma 4 text config small enough for seconds on CPU; the last 3 of 6 layers reuse the KV of
    earlier layers (``num_kv_shared_layers``), which is what accelerate's dict copies break."""
    require_gemma4()
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, num_kv_shared_layers=3, sliding_window=16,
        max_position_embeddings=64, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    )


def save_tiny_gemma4(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    Gemma4ForCausalLM(tiny_gemma4_config()).eval().save_pretrained(path)
    return path


def _save_checkpoint(arch: str, path: Path) -> Path:
    if arch == "gemma4":
        return save_tiny_gemma4(path)
    from ._models import save_tiny_llama

    return save_tiny_llama(path)


def offload_map(arch: str, main: Any = None) -> Dict[str, Any]:
    """Embeddings, head and the first layers in memory on ``main`` (a device-map value; default: the
    execution device, ``_device.main_device()``); the last layers on disk. For Gemma 4 the disk layers
    include KV-shared ones and their sources (layers 3-5 reuse 1 and 2). With a GPU main device, layer 1
    is offloaded to ``cpu`` as well: the GPU/cpu/disk map of the seeds (without one, ``cpu`` is memory)."""
    if main is None:
        from ._device import main_device

        main = main_device()
    layers = 4 if arch == "llama" else 6
    device_map: Dict[str, Any] = {"model.embed_tokens": main, "model.norm": main, "model.rotary_emb": main,
                                  "lm_head": main}
    if arch == "gemma4":
        device_map.update({"model.embed_tokens_per_layer": main, "model.per_layer_model_projection": main,
                           "model.per_layer_projection_norm": main})
    for i in range(layers):
        device_map[f"model.layers.{i}"] = main if i < 2 else "disk"
    if main != "cpu":
        device_map["model.layers.1"] = "cpu"
    return device_map


def save_adapter(arch: str, checkpoint: Path, path: Path, seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                        init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(path)
    return path


# -- side effects --------------------------------------------------------------------------------


def _hashes(folder: Path) -> Dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _listing(folder: Path, recursive: bool, skip: Optional[Path] = None) -> set:
    if not recursive:
        return set(os.listdir(folder))
    found = set()
    for root, dirs, files in os.walk(folder):
        if skip is not None:
            dirs[:] = [d for d in dirs if Path(root, d) != skip]
        found.update(os.path.relpath(os.path.join(root, name), folder) for name in dirs + files)
    return found


class _SideEffects:
    """What the load may not touch: the checkpoint, the working directory, the work directory
    outside the offload folders."""

    def __init__(self, workdir: Path, checkpoint: Path, offload_folders: tuple):
        self.workdir, self.checkpoint = workdir, checkpoint
        self.cwd = Path(os.getcwd()).resolve()
        # "/" is listed one level deep only: the bug's writes there land inside existing folders
        # (tmp/...), which the checkpoint hash catches.
        self.recursive_cwd = self.cwd != Path("/")
        self.allowed = tuple(workdir / name for name in offload_folders)
        self.before = self._snapshot()

    def _snapshot(self) -> tuple:
        work = {p for p in _listing(self.workdir, True)
                if not any((self.workdir / p).is_relative_to(a) for a in self.allowed)}
        inside = self.workdir.resolve().is_relative_to(self.cwd)
        cwd = _listing(self.cwd, self.recursive_cwd, skip=self.workdir.resolve() if inside else None)
        return _hashes(self.checkpoint), work, cwd

    def problems(self) -> list:
        hashes, work, cwd = self._snapshot()
        found = []
        if hashes != self.before[0]:
            changed = sorted(k for k in set(hashes) | set(self.before[0]) if hashes.get(k) != self.before[0].get(k))
            found.append(f"checkpoint files modified in place: {changed}")
        if work - self.before[1]:
            new = sorted(work - self.before[1])[:5]
            found.append(f"new files in the work directory outside the offload folders: {new}")
        if cwd - self.before[2]:
            found.append(f"new files in the working directory {self.cwd}: {sorted(cwd - self.before[2])[:5]}")
        return found


# -- comparisons ---------------------------------------------------------------------------------


def _logits_and_tokens(model: Any, ids: Any) -> tuple:
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(input_ids=ids, max_new_tokens=_NEW_TOKENS, do_sample=False)
    return logits, tokens


def _compare(name: str, got: tuple, want: tuple) -> float:
    import torch

    from ._models import max_abs_diff

    diff = max_abs_diff(got[0], want[0])
    if not torch.equal(got[0], want[0]):
        raise AssertionError(f"{name}: logits differ from the in-memory reference (max abs diff {diff})")
    if not torch.equal(got[1], want[1]):
        raise AssertionError(f"{name}: greedy tokens differ: {got[1].tolist()} vs {want[1].tolist()}")
    return diff
