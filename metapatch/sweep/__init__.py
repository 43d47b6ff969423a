"""``metapatch sweep``: every causal-LM and seq2seq architecture of the installed transformers,
built tiny, saved, loaded with several offload placements and compared with the in-memory model,
without and with metapatch. The parent runs no model: each leg of each architecture is its own process (metapatch.sweep.child), results are cached per stack (resumable), and
docs/sweep.md is rendered from the cache (metapatch.sweep.render)."""

from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Tuple

PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parent.parent
LEGS = ("unpatched", "patched")

# The CI sample (tests/test_sweep.py): a plain decoder, a Conv1D decoder with learned positions and a
# tied head, two encoder-decoders (T5; Bart with a top-level buffer, final_logits_bias), a mixture of
# experts, and a decoder with scaled embeddings and sliding-window layers.
SAMPLE = ("LlamaForCausalLM", "GPT2LMHeadModel", "T5ForConditionalGeneration", "BartForConditionalGeneration",
          "MixtralForCausalLM", "Gemma3ForCausalLM")


def architectures() -> List[Tuple[str, str]]:
    """(model class name, model_type) for every causal-LM and seq2seq-LM mapping entry, sorted."""
    from transformers.models.auto import modeling_auto

    rows: Dict[str, List[str]] = {}
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES):
        for model_type, names in mapping.items():
            for name in (names,) if isinstance(names, str) else names:
                rows.setdefault(name, []).append(model_type)
    return sorted(((name, _own_model_type(name, types)) for name, types in rows.items()),
                  key=lambda item: item[0].lower())


def _own_model_type(class_name: str, model_types: List[str]) -> str:
    """Of the model types mapped to ``class_name``, the one whose config class is the model class's own
    (``LlamaForCausalLM``: ``llama``, not ``exaone``; ``Qwen3_5ForCausalLM``: ``qwen3_5_text``, not the
    composite ``qwen3_5``, which that class cannot be built from); the first where none is or the class
    does not import."""
    if len(model_types) == 1:
        return model_types[0]
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        own = getattr(transformers, class_name).config_class
    except Exception:  # noqa: BLE001 - a class that does not import keeps the first type (its row says why)
        return model_types[0]
    if getattr(own, "model_type", None) in model_types:
        return own.model_type
    return next((t for t in model_types if CONFIG_MAPPING_NAMES.get(t) == own.__name__), model_types[0])


def versions() -> Dict[str, str]:
    found = {}
    for dist in ("torch", "transformers", "accelerate"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "absent"
    return found


def stack_name(found: Dict[str, str]) -> str:
    return "_".join(f"{dist}-{version}" for dist, version in sorted(found.items()))


def _digest(paths: List[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(str(path.relative_to(REPO)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_keys() -> Dict[str, str]:
    """What every cached leg must have been run with: the harness (child, flows and placements) for both legs,
    and for the patched leg also every module a patch can reach (not the CLI, survey, selftest or report
    tooling). The shrinking rules enter per architecture, through the config they make
    (:func:`arch_keys`): a rule that changes one architecture's config reruns that architecture only."""
    harness = _digest([PACKAGE / name for name in ("child.py", "flows.py", "placements.py")])
    skip = {"sweep", "commands", "survey", "selftest", "reports"}
    patched = [p for p in (REPO / "metapatch").rglob("*.py")
               if p.relative_to(REPO / "metapatch").parts[0] not in skip]
    return {"unpatched": harness, "patched": harness + "-" + _digest(patched)}


def config_digest(model_type: str) -> str:
    """The digest of the tiny config the child builds for ``model_type`` (metapatch.sweep.shrink), or of
    the error it would fail with: the same config is the same experiment, whatever else the rules say."""
    import logging

    from transformers import CONFIG_MAPPING

    from metapatch.sweep import shrink

    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the default config's own warnings, not ours to show
    try:
        text = shrink.tiny_config(CONFIG_MAPPING[model_type]).to_json_string(use_diff=False)
    except Exception as exc:  # the child fails the same way: its build error is the cached result
        text = f"{type(exc).__name__}: {exc}"
    finally:
        quiet.setLevel(level)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def arch_keys(stamp: Dict[str, str], model_type: str) -> Dict[str, str]:
    """The per-leg keys of one architecture: ``HARNESS.CONFIG`` and ``HARNESS.CONFIG-CODE``."""
    harness, _, code = stamp["patched"].partition("-")
    config = config_digest(model_type)
    return {"unpatched": f"{harness}.{config}", "patched": f"{harness}.{config}-{code}"}


def cache_root() -> Path:
    root = os.environ.get("METAPATCH_SWEEP_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "metapatch" / "sweep"
