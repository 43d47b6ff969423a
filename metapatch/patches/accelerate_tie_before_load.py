"""accelerate-tie-before-load: ``load_checkpoint_and_dispatch`` and ``load_checkpoint_in_model`` tie the
weights of a model built under ``init_empty_weights`` before loading it.

accelerate's big-model recipe builds the model under ``init_empty_weights`` and loads it with
``load_checkpoint_and_dispatch``. transformers ties a model's declared ties (``tie_word_embeddings``:
``lm_head.weight`` is ``embed_tokens.weight``) in ``from_pretrained`` and, for a model built in memory,
at construction; a model built under ``init_empty_weights`` is not tied (measured on 4.57.6, 5.11.0,
5.24.0). Its checkpoint stores the tied group once (``save_pretrained`` drops ``lm_head.weight``), so
the untied copy never gets a value: ``ValueError: weight is on the meta device, we need a `value` to put
in on cpu.`` when dispatching, or ``Cannot copy out of meta tensor`` with ``device_map="auto"`` (whose
map inference also places the untied head apart from the embedding). accelerate only warns ("The
model weights are not tied. Please use the `tie_weights` method"); its docs tell users to call
``model.tie_weights()`` first (huggingface/accelerate#1289).

The fix does that call for them, before the device map is inferred (so a tied group is placed
together), and only when it is what the model itself would do: the model has a callable
``tie_weights``, declares ties that are not in place, and a member of such a tie is still on the meta
device (an unmaterialised model; a materialised model that someone untied on purpose is left alone).
An untied model, or one already tied, is passed through unchanged.

Tied, the group still has one value in the checkpoint, at its source, and upstream's loader fills only
the source: with the pair on disk, or split across cpu/disk by the device map, the copy stays without a
value (``KeyError: 'lm_head.weight'`` at the first forward: the offload index has only the source; or
``weight is on the meta device, we need a `value```), where ``from_pretrained`` loads the same map. After
``load_checkpoint_in_model``, each declared copy mapped to disk gets its own entry in the user's offload
folder (where accelerate writes every disk-mapped weight), and a copy mapped to a device that is still
on meta is loaded from its source's offload file. Only maps with a disk entry and an offload folder are
looked at.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Tuple

from metapatch._framework.calls import signature_of
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream
from metapatch.patches._shared_targets import shared_fingerprints
from metapatch._offload.tied_members import declared_mappings

PATCH_ID = "accelerate-tie-before-load"


def _decoder_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        try:
            return get_text_config(decoder=True)
        except TypeError:  # an older signature without `decoder`
            return get_text_config()
    return config


def _untied_word_embeddings(model: Any, parameters: Dict[str, Any]) -> List[Tuple[str, str]]:
    """transformers 4.x declares only ``tie_word_embeddings`` (no expanded mapping): the output embedding
    is meant to be the input embedding."""
    if not getattr(_decoder_config(model), "tie_word_embeddings", False):
        return []
    try:
        output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model without one of them has nothing to tie
        return []
    output_weight, input_weight = getattr(output, "weight", None), getattr(inputs, "weight", None)
    if output_weight is None or input_weight is None or output_weight is input_weight:
        return []
    name_of = {id(param): name for name, param in parameters.items()}
    return [(name_of.get(id(output_weight), "output embeddings"), name_of.get(id(input_weight), "input embeddings"))]


def untied_declared_ties(model: Any) -> List[Tuple[str, str]]:
    """(target, source) parameter names that ``model`` declares tied but that are different tensors, for
    the ties with a member on the meta device."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    pairs: List[Tuple[str, str]] = []
    declared = False
    for prefix, mapping in declared_mappings(model):  # transformers 5: the expanded, config-aware mapping
        declared = True
        for target, source in mapping.items():
            target, source = prefix + target, prefix + source
            if target in parameters and source in parameters and parameters[target] is not parameters[source]:
                pairs.append((target, source))
    if not declared:
        pairs = _untied_word_embeddings(model, parameters)
    return [(target, source) for target, source in pairs
            if any(getattr(parameters.get(name), "is_meta", False) for name in (target, source))]


def tie_if_declared(model: Any) -> bool:
    """Call ``model.tie_weights()`` when the model declares ties that an empty build left undone; True
    when it did."""
    if not callable(getattr(model, "tie_weights", None)) or not untied_declared_ties(model):
        return False
    model.tie_weights()
    return True


def _declared_pairs(model: Any, parameters: Dict[str, Any]) -> List[Tuple[str, str]]:
    """Every declared (target, source) tie by parameter name, tied in place or not."""
    pairs: List[Tuple[str, str]] = []
    declared = False
    for prefix, mapping in declared_mappings(model):
        declared = True
        pairs += [(prefix + t, prefix + s) for t, s in mapping.items()
                  if prefix + t in parameters and prefix + s in parameters]
    if declared or not getattr(_decoder_config(model), "tie_word_embeddings", False):
        return pairs
    try:
        output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return pairs
    names = {id(module): name for name, module in model.named_modules()}
    if output is not None and inputs is not None and id(output) in names and id(inputs) in names:
        target, source = names[id(output)] + ".weight", names[id(inputs)] + ".weight"
        if target in parameters and source in parameters and target != source:
            pairs.append((target, source))
    return pairs


def _mapped(device_map: Mapping, name: str) -> Any:
    """The device ``device_map`` gives parameter ``name`` (its longest module prefix)."""
    best = None
    for key in device_map:
        if (key == "" or name == key or name.startswith(key + ".")) and (best is None or len(key) > len(best)):
            best = key
    return None if best is None else device_map[best]


def _complete_tied_copies(model: Any, device_map: Any, offload_folder: Any) -> None:
    """After upstream's ``load_checkpoint_in_model``, give each declared tied copy the value the checkpoint
    stores once, at its source, where the copy's device map entry differs from what upstream filled in:

    * a copy mapped to disk whose name is not in the offload index (both on disk: the index holds only the
      source; source on cpu): written to the user's ``offload_folder`` under its own name, as accelerate
      writes every disk-mapped weight there (``KeyError: 'lm_head.weight'`` at the first forward upstream);
    * a copy mapped to a device that is still on meta because its source went to disk: loaded from the
      source's offload file onto that device (upstream: ``weight is on the meta device, we need a `value```).

    Checked first, cheaply: only a map with a disk entry and an offload folder can need it."""
    import json
    import os

    if not isinstance(device_map, Mapping) or offload_folder is None or "disk" not in device_map.values():
        return
    from accelerate.utils import set_module_tensor_to_device
    from accelerate.utils.offload import load_offloaded_weight, offload_weight, save_offload_index

    parameters = dict(model.named_parameters(remove_duplicate=False))
    pairs = _declared_pairs(model, parameters)
    if not pairs:
        return
    index_file = os.path.join(offload_folder, "index.json")
    index: Dict[str, Any] = {}
    if os.path.isfile(index_file):
        with open(index_file, encoding="utf-8") as f:
            index = json.load(f)
    added: Dict[str, Any] = {}

    def source_value(source: str) -> Any:
        if _mapped(device_map, source) == "disk" and source in index:
            return load_offloaded_weight(os.path.join(offload_folder, f"{source}.dat"), index[source])
        value = parameters[source]
        if value.is_meta:
            raise MetapatchError(
                f"metapatch ({PATCH_ID}): {source} (the source of a declared tie) has no value after loading the "
                f"checkpoint: neither the checkpoint nor the offload folder holds it, so its tied copies cannot be "
                f"filled. Check that the checkpoint belongs to this model.")
        return value.detach()

    for target, source in pairs:
        device = _mapped(device_map, target)
        if device == "disk":
            if target not in index and target not in added:
                offload_weight(source_value(source), target, offload_folder, index=added)
        elif device is not None and parameters[target].is_meta:
            set_module_tensor_to_device(model, target, device, value=source_value(source))
    save_offload_index(added, offload_folder)


def _tie_then_load(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    model = bound.arguments.get("model")
    if model is not None:
        tie_if_declared(model)
    return wrapped(*args, **kwargs)


def _tie_then_load_in_model(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    model = bound.arguments.get("model")
    if model is not None:
        tie_if_declared(model)
    result = wrapped(*args, **kwargs)
    if model is not None:
        _complete_tied_copies(model, bound.arguments.get("device_map"), bound.arguments.get("offload_folder"))
    return result


PATCH = Patch(
    id=PATCH_ID,
    title="load_checkpoint_and_dispatch / load_checkpoint_in_model tie a model built under init_empty_weights "
          "before loading (a tied head stored once had no value)",
    # Measured unpatched (selftest explicit-map: ValueError "we need a `value`"; auto: NotImplementedError
    # "Cannot copy out of meta tensor"): accelerate 1.10.1, 1.13.0, 1.15.0 with transformers 4.57.6, 5.11.0,
    # 5.24.0. No release ties before loading, so the range stays open; the fingerprints notice a change.
    affects={"accelerate": ">=1.10.0"},
    targets=(
        Target("accelerate.big_modeling", "load_checkpoint_and_dispatch",
               fingerprints=("fdfe5f0205f72033",),  # accelerate 1.10.0 - 1.15.0 (unchanged)
               wrapper=_tie_then_load, aliases=("accelerate:load_checkpoint_and_dispatch",)),
        Target("accelerate.utils.modeling", "load_checkpoint_in_model",
               fingerprints=shared_fingerprints("accelerate.utils.modeling:load_checkpoint_in_model"),
               wrapper=_tie_then_load_in_model,
               aliases=("accelerate:load_checkpoint_in_model", "accelerate.utils:load_checkpoint_in_model",
                        "accelerate.big_modeling:load_checkpoint_in_model")),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/issues/1289",),
        forwarded="no",
        note="accelerate: load_checkpoint_in_model (and load_checkpoint_and_dispatch, before inferring the device "
             "map) call model.tie_weights() when the config declares ties that a meta model does not have yet",
    ),
)
