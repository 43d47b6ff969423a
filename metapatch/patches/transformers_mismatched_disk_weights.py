"""transformers-mismatched-disk-weights: a weight whose checkpoint shape differs from the model's (a new
classification head, ``from_pretrained(..., num_labels=<other>, ignore_mismatched_sizes=True)``) and which the
device map puts on disk is re-initialised as in memory, instead of being served as the checkpoint's tensor.

transformers 5 loads a disk-mapped tensor without looking at it: ``offload_and_maybe_resave_param`` keeps the
disk offload index entry that ``accelerate_disk_offload`` made from the checkpoint (a safetensors checkpoint:
the entry points into it; otherwise the tensor is re-saved into the offload folder as it is), and never
compares the shapes. The in-memory path does (``set_param_for_module``): a different shape is a mismatched
key, re-initialised by the model when ``ignore_mismatched_sizes=True`` and refused at load otherwise. On disk
the mismatch is never recorded: the module keeps a meta placeholder of the new shape, nothing initialises it,
and the offload hook loads the checkpoint's tensor into it at the first forward: ``ValueError: Trying to set
a tensor of shape torch.Size([5, 64]) in "weight" (which has shape torch.Size([2, 64]))``. Any tensor of any
architecture on disk meets it (classification heads, ``score``/``classifier`` weights and biases), and with
``ignore_mismatched_sizes=False`` the load that memory refuses goes through until that forward.

The same path skips the in-memory load's dtype: a disk-mapped tensor is read and cast as memory would cast it
(``_keep_in_fp32_modules``: T5's ``wo`` stays float32 in a float16 model), then dropped; the module keeps the
placeholder the model was built with (float16) and the index entry says float16, so the hook serves a float16
``wo`` where memory computes in float32 (a T5 loaded with ``dtype=torch.float16`` and its blocks on disk is
0.004 off the in-memory float16 model). Any model with ``_keep_in_fp32_modules`` (or a dtype plan) meets it.

The fix, where the load made a disk offload index: once the checkpoint is loaded, each index entry's shape
(read from the safetensors header it points to, never the tensor) is compared with the model's tensor, as
``set_param_for_module`` compares in memory; a different shape (not a weight the quantizer packs) becomes a
mismatched key and its entry leaves the index. transformers then does what it does in memory: it refuses the
load unless ``ignore_mismatched_sizes=True``, and otherwise materialises the tensor in CPU memory (its
``"disk"`` entry read as ``"cpu"``) and initialises it exactly as the in-memory load would. The initialised
value is served to the offload hook from memory, in front of the index, by the mechanism of
``accelerate-unindexed-disk-tensors`` (a tensor the model holds that the index lacks: the offload store's
``Overlay``); nothing is written into the offload folder or the checkpoint. A disk-mapped tensor that the load
made in another dtype than its placeholder's (the value ``offload_and_maybe_resave_param`` receives, cast as
memory casts it) gets a placeholder of that dtype, and its index entry that dtype, so the hook serves what the
in-memory load holds. Everywhere else (no disk entry, every shape and dtype equal) the index and the
placeholders are left as upstream made them.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any, Callable, Dict, Optional, Tuple

from metapatch._framework.calls import signature_of
from metapatch._framework.records import Patch, Target, Upstream
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "transformers-mismatched-disk-weights"

# While convert_and_load_state_dict_in_model runs: {disk-mapped name: the dtype the load made its value in}.
_LOADED_DTYPES: "contextvars.ContextVar[Optional[Dict[str, Any]]]" = contextvars.ContextVar(
    "metapatch_disk_loaded_dtypes", default=None)


class _Headers:
    """Shapes of tensors in safetensors files, read from their headers (each file opened once)."""

    def __init__(self) -> None:
        self.files: Dict[str, Any] = {}

    def shape(self, entry: Any) -> Optional[Tuple[int, ...]]:
        if not isinstance(entry, Mapping):
            return None
        if entry.get("shape") is not None:  # an index written by accelerate's offload_weight
            return tuple(entry["shape"])
        path, name = entry.get("safetensors_file"), entry.get("weight_name")
        if not path or not name:
            return None
        handle = self.files.get(path)
        if handle is None:
            from safetensors import safe_open

            handle = self.files[path] = safe_open(path, framework="pt")
        return tuple(handle.get_slice(name).get_shape())


def _packed_by_quantizer(quantizer: Any, model: Any, name: str) -> bool:
    """A weight the quantizer stores in another shape than the module declares (the in-memory check skips
    it too)."""
    if quantizer is None:
        return False
    needs = getattr(quantizer, "param_needs_quantization", None)
    return bool(needs(model, name)) if needs is not None else True


def mismatched_entries(model: Any, index: Mapping[str, Any], quantizer: Any = None) -> Dict[str, Tuple[Any, Any]]:
    """{name: (checkpoint shape, model shape)} for the entries of the disk offload ``index`` whose tensor does
    not have the shape of the model's tensor of that name."""
    import torch

    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    headers = _Headers()
    found = {}
    for name, entry in index.items():
        tensor = tensors.get(name)
        if tensor is None or _packed_by_quantizer(quantizer, model, name):
            continue
        shape = headers.shape(entry)
        if shape is not None and shape != tuple(tensor.shape):
            found[name] = (torch.Size(shape), tensor.shape)
    return found


def _plain_floating(value: Any) -> bool:
    """A floating tensor of torch's own classes (a quantized library's tensor keeps its own placeholder)."""
    import torch

    return type(value) in (torch.Tensor, torch.nn.Parameter) and value.is_floating_point()


def _offload_and_maybe_resave_param(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                                    kwargs: Dict[str, Any]) -> Any:
    dtypes = _LOADED_DTYPES.get()
    if dtypes is not None:
        arguments = signature_of(wrapped).bind_partial(*args, **kwargs).arguments
        param = arguments.get("param")
        if _plain_floating(param):
            dtypes[arguments["target_name"]] = param.dtype
    return wrapped(*args, **kwargs)


def _replace_placeholder(model: Any, name: str, dtype: Any) -> bool:
    """Give the meta placeholder of ``name`` (every module holding it: ties) the dtype ``dtype``."""
    import torch

    path, _, local = name.rpartition(".")
    owner = model.get_submodule(path) if path else model
    old = owner._parameters.get(local)
    if old is None:
        old = owner._buffers.get(local)
    if old is None or not old.is_meta or old.dtype == dtype or not old.is_floating_point():
        return False
    new = torch.empty_like(old, dtype=dtype, device="meta")
    if isinstance(old, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
    new.__dict__.update(getattr(old, "__dict__", {}))  # transformers' flags (_is_hf_initialized, ...)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, value in table.items():
                if value is old:
                    table[key] = new
    return True


def _convert_and_load_state_dict_in_model(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                                          kwargs: Dict[str, Any]) -> Any:
    dtypes: Dict[str, Any] = {}
    token = _LOADED_DTYPES.set(dtypes)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _LOADED_DTYPES.reset(token)
    loading_info, index = result
    if not index:  # no disk entry: the common case costs this test
        return result
    arguments = signature_of(wrapped).bind_partial(*args, **kwargs).arguments
    model, load_config = arguments.get("model"), arguments.get("load_config")
    quantizer = getattr(load_config, "hf_quantizer", None)
    for name, (checkpoint, expected) in mismatched_entries(model, index, quantizer).items():
        # what set_param_for_module records in memory; _finalize_model_loading then refuses the load or
        # materialises and initialises the tensor, and accelerate-unindexed-disk-tensors serves it
        loading_info.mismatched_keys.add((name, checkpoint, expected))
        del index[name]
    for name, dtype in dtypes.items():
        entry = index.get(name)
        if isinstance(entry, dict) and _replace_placeholder(model, name, dtype):
            # the loader casts what it reads to the entry's dtype: the dtype the in-memory load holds
            entry["dtype"] = str(dtype).replace("torch.", "")
    return result


PATCH = Patch(
    id=PATCH_ID,
    title="from_pretrained gives a weight mapped to disk what the in-memory load gives it: a mismatched shape "
          "(a new head, ignore_mismatched_sizes=True) re-initialised instead of the checkpoint's tensor of the old "
          "shape, and the in-memory dtype (_keep_in_fp32_modules) instead of the model's default",
    # Measured (selftest, unpatched: ValueError "Trying to set a tensor of shape ..." at the first forward):
    # transformers 5.7.0, 5.11.0 and 5.25.0. Every variant from 5.1.0 on returns (loading_info,
    # disk_offload_index), records in-memory mismatches as (name, checkpoint shape, model shape) and sends
    # disk-mapped tensors to offload_and_maybe_resave_param without a shape check (read in each). 5.0.0 loads
    # on an earlier form of this function (no loading_info) and is left out; transformers 4.57 finds mismatched
    # keys from the checkpoint before it builds the disk index (_find_mismatched_keys): not affected.
    affects={"transformers": ">=5.1.0"},
    targets=(
        Target("transformers.core_model_loading", "convert_and_load_state_dict_in_model",
               fingerprints=(
                   "730cfa0a555fd5d4",  # 5.1.0 - 5.2.0
                   "62616879b7b48f2e",  # 5.3.0
                   "0ac1d861a2c5c82e",  # 5.4.0 - 5.5.4
                   "d03ec438a88c7f65",  # 5.6.0 - 5.8.1
                   "0f60a48ae003e809",  # 5.9.0
                   "e2dd78418a73aa84",  # 5.10.1 - 5.13.1
                   "d7bfa1112afb64ef",  # 5.14.x
                   "3b849f45104c1158",  # 5.15.x
                   "fe7a45c2e2b74af3",  # 5.16.x
                   "1cea3cf9cbf6e22b",  # 5.17.0 - 5.20.2
                   "fdc63bebb2c49b9c",  # 5.21.0 - 5.22.2
                   "8e65a9082712f010",  # 5.23.0 - 5.25.0
               ),
               wrapper=_convert_and_load_state_dict_in_model,
               aliases=("transformers.modeling_utils:convert_and_load_state_dict_in_model",)),
        Target("transformers.core_model_loading", "offload_and_maybe_resave_param",
               fingerprints=shared_fingerprints("transformers.core_model_loading:offload_and_maybe_resave_param"),
               wrapper=_offload_and_maybe_resave_param),
    ),
    # It only reads the value it is given; the quantized-weights patch may replace that value (packed 4-bit
    # data, skipped here) and goes inside.
    wraps_over=("transformers-quantized-disk-weights",),
    upstream=Upstream(
        bug=(),
        forwarded="no",
        note="transformers: a disk-mapped tensor whose shape differs from the model's is a mismatched key, as in "
             "memory, and leaves the disk offload index; serving the initialised value needs accelerate's "
             "dispatch_model to keep tensors the index lacks (accelerate-unindexed-disk-tensors' diff)",
    ),
)
