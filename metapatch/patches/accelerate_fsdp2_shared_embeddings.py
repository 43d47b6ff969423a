"""accelerate-fsdp2-shared-embeddings: accelerate's FSDP2 prepare puts every module that holds a
tied embedding weight into one FSDP group.

Since 1.14, ``fsdp2_prepare_model`` carves the embeddings, the final norm and ``lm_head`` into their
own FSDP groups and leaves the rest to the root group, and a tied weight ends up managed by two
groups: in accelerate 1.14 ``lm_head`` stays in the root while the input embedding goes to the tail
group (fixed in 1.15 by huggingface/accelerate#4171); in 1.15 the tail group holds
``get_input_embeddings()`` and ``get_output_embeddings()`` but not other modules holding the same
weight, such as BART's encoder and decoder ``embed_tokens`` (open). torch 2.13 checks at the first
forward that no parameter is managed by two groups (``Parameter 'model.shared.weight' is shared with
a parameter already managed by another FSDP group``); torch 2.12 and older do not check, and the
shared weight trains wrong on every rank, silently (measured on torch 2.11 with BART: logits after
one SGD step 3.98 off a single process's, against a step change of 4.70).

During ``fsdp2_prepare_model`` the wrapper hands the groups accelerate builds (every call but the
root's) to ``fully_shard`` together with the modules outside them that hold one of their
parameters directly, as torch asks ("use fully_shard([module_a, module_b])"). Where such a module
already sits in another FSDP group, nothing is changed and torch's error stands. A model without a
parameter held by two modules goes to upstream untouched.
"""

from __future__ import annotations

import functools
from typing import Any, List, Set

from metapatch._framework.calls import signature_of
from metapatch._framework.records import Patch, Target, Upstream
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "accelerate-fsdp2-shared-embeddings"


def _holders(model: Any) -> dict:
    """id(parameter) -> the modules holding it directly, for parameters held by two or more."""
    holders: dict = {}
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None:
                holders.setdefault(id(parameter), []).append(module)
    return {key: modules for key, modules in holders.items() if len(modules) > 1}


def _in_groups(model: Any) -> Set[int]:
    from torch.distributed.fsdp import FSDPModule

    inside: Set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule) and module is not model:
            inside.update(id(m) for m in module.modules())
    return inside


def _with_holders(model: Any, shared: dict, modules: Any) -> Any:
    group: List[Any] = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    covered = {id(m) for top in group for m in top.modules()}
    extra: List[Any] = []
    for top in group:
        for parameter in top.parameters():
            for holder in shared.get(id(parameter), ()):
                if id(holder) not in covered and all(holder is not m for m in extra):
                    extra.append(holder)
    if not extra:
        return modules
    grouped = _in_groups(model)
    if any(holder is model or id(holder) in grouped for holder in extra):
        return modules  # held inside another group too: not ours to regroup; torch's error stands
    return group + extra


def _prepare(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    model = signature_of(wrapped).bind(*args, **kwargs).arguments["model"]
    if not _holders(model):
        return wrapped(*args, **kwargs)
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard

    @functools.wraps(original)
    def fully_shard(module: Any, *a: Any, **kw: Any) -> Any:
        if module is not model:  # the holders again: cpu_ram_efficient_loading moved the model to meta and re-tied it
            module = _with_holders(model, _holders(model), module)
        return original(module, *a, **kw)

    # fsdp2_prepare_model imports fully_shard from torch.distributed.fsdp inside its body, at each call
    fsdp.fully_shard = fully_shard
    try:
        return wrapped(*args, **kwargs)
    finally:
        fsdp.fully_shard = original


PATCH = Patch(
    id=PATCH_ID,
    title="accelerate FSDP2 prepare groups every module holding a tied embedding weight (torch >= 2.13: no 'shared "
          "with a parameter already managed by another FSDP group'; older torch: no silently wrong training step; "
          "tied LMs on 1.14, BART on 1.15 and 1.16)",
    # Measured (two ranks, gloo): accelerate 1.14.0 fails on a tied Llama and on BART, 1.15.0 and 1.16.0 on
    # BART, with torch 2.13.0 (ValueError) and torch 2.11.0 (every rank's step wrong, AssertionError in the
    # scenarios); 1.13.0 has no embedding/tail groups (every tie stays in the root group).
    affects={"accelerate": ">=1.14"},
    targets=(
        Target("accelerate.utils.fsdp_utils", "fsdp2_prepare_model",
               fingerprints=shared_fingerprints("accelerate.utils.fsdp_utils:fsdp2_prepare_model", since="1.14.0"),
               wrapper=_prepare,
               aliases=("accelerate.utils:fsdp2_prepare_model", "accelerate.accelerator:fsdp2_prepare_model")),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/pull/4171",),
        forwarded="no",
        note="accelerate 1.15 (#4171) groups get_input_embeddings and get_output_embeddings; other modules "
             "holding the tied weight (BART's encoder/decoder embed_tokens) are still left to the root",
    ),
)
