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
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from metapatch._calls import signature_of
from metapatch._records import Patch, Target, Upstream
from metapatch._tied_groups import _declared_mappings

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
    for prefix, mapping in _declared_mappings(model):  # transformers 5: the expanded, config-aware mapping
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


def _tie_then_load(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    model = bound.arguments.get("model")
    if model is not None:
        tie_if_declared(model)
    return wrapped(*args, **kwargs)


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
               fingerprints=("5b18bd1bf317a2c4",  # accelerate 1.10.0 - 1.10.1
                             "18e8cb3be7919183"),  # accelerate 1.11.0 - 1.15.0
               wrapper=_tie_then_load,
               aliases=("accelerate:load_checkpoint_in_model", "accelerate.utils:load_checkpoint_in_model",
                        "accelerate.big_modeling:load_checkpoint_in_model")),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/issues/1289",),
        forwarded="no",
        note="accelerate: load_checkpoint_in_model (and load_checkpoint_and_dispatch, before inferring the device "
             "map) call model.tie_weights() when the config declares ties that a meta model does not have yet",
    ),
    diffs=("upstream_diffs/accelerate-tie-before-load/accelerate.diff",),
    selftest="metapatch.selftest.accelerate_tie",
)
