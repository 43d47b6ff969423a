"""accelerate-dispatch-skip-keys: ``accelerate.dispatch_model`` called without ``skip_keys`` uses the
model's own ``_skip_keys_device_placement`` (looked up through a PEFT wrapper too); an explicit
``skip_keys=None`` is left alone.

accelerate's hooks move every forward kwarg to the execution device with ``send_to_device``, which
rebuilds each mapping it is handed. Gemma 4's KV-shared layers communicate through a dict passed as
a kwarg (``shared_kv_states``): each hooked layer then writes its KV into a copy, and the first
KV-shared layer fails with ``KeyError: 3`` (transformers 5.7, integer keys) or ``KeyError:
'sliding_attention'`` (5.11). transformers' own ``from_pretrained`` passes the model's keys;
``accelerate.dispatch_model`` called directly (and PEFT's re-dispatch) does not. transformers 5.23
made the dict survive the copy (``KVSharingDict``), so the range ends there.
"""

from __future__ import annotations

from typing import Any, List, Optional

from metapatch._framework.calls import signature_of
from metapatch._framework.records import Patch, Target, Upstream
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "accelerate-dispatch-skip-keys"


def model_skip_keys(model: Any) -> Optional[List[str]]:
    """The model's ``_skip_keys_device_placement`` as a list, looking inside PEFT wrappers (whose
    ``__getattr__`` forwarding is not relied on: ``get_base_model`` says what is wrapped)."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        keys = getattr(model, "__dict__", {}).get("_skip_keys_device_placement",
                                             getattr(type(model), "_skip_keys_device_placement", None))
        if keys:
            return [keys] if isinstance(keys, str) else sorted(keys)
        get_base = getattr(type(model), "get_base_model", None)
        model = get_base(model) if callable(get_base) else None
    return None


def _dispatch_model(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    # Only when the caller left skip_keys out: an explicit ``skip_keys=None`` keeps accelerate's
    # meaning (move every input), as the upstream diff does.
    if "skip_keys" not in bound.arguments and "model" in bound.arguments:
        keys = model_skip_keys(bound.arguments["model"])
        if keys:
            bound.arguments["skip_keys"] = keys
    return wrapped(*bound.args, **bound.kwargs)


PATCH = Patch(
    id=PATCH_ID,
    title="accelerate.dispatch_model without skip_keys keeps the model's _skip_keys_device_placement "
          "(Gemma 4 shared KV)",
    # The harm is measured on Gemma 4 from its first release (transformers 5.5.0; `metapatch survey
    # --run` measured 5.5.4 affected, the range said 5.6 before) up to 5.22; 5.23 fixed its side
    # with KVSharingDict, whose in-place .to survives accelerate's copies (5.24.0 measured). The
    # accelerate side (the default) is unfixed in every release: the fingerprint guards it.
    affects={"transformers": ">=5.5,<5.23", "accelerate": ">=1.0"},
    targets=(
        Target("accelerate.big_modeling", "dispatch_model",
               fingerprints=shared_fingerprints("accelerate.big_modeling:dispatch_model"),
               wrapper=_dispatch_model, aliases=("accelerate:dispatch_model",)),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/issues?q=dispatch_model+skip_keys+shared_kv_states",
             "https://github.com/huggingface/transformers/issues?q=Gemma4+shared_kv_states+KeyError"),
        forwarded="no",
        fixed_in={"transformers": "5.23.0"},
        note="accelerate: dispatch_model's skip_keys defaults to the model's _skip_keys_device_placement",
    ),
    diagnoses=("skip-keys-missing",),  # metapatch.diagnose findings this fixes
)
