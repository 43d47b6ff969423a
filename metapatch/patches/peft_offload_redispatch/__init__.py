"""peft-offload-redispatch: PEFT adapters over a base model offloaded to cpu/disk by accelerate give
the results of the in-memory model, keep the base's placement and its checkpoint files untouched.

Upstream PEFT (0.17.0-0.22.0 measured, unfixed in 0.22.0):

* ``PeftModel.load_adapter`` re-dispatches the wrapped model whenever the base's ``hf_device_map``
  holds ``cpu`` or ``disk``: it infers a brand-new map (everything fits in memory on a CPU-only
  machine, so ``dispatch_model`` calls ``model.to`` on meta weights), has ``_update_offload`` rewrite
  the base's safetensors file to ``os.path.join(*fname.split(os.sep))`` (an absolute path made
  relative to the working directory: run from ``/`` it overwrites the user's checkpoint, elsewhere it
  copies it), and dispatches without ``skip_keys`` (Gemma 4's shared KV is then written into copies);
* every tuner moves a new adapter onto its base layer's device, which for an offloaded layer is
  ``meta``: ``get_peft_model`` then runs with LoRA weights on meta (silently wrong logits), DoRA's
  initialisation reads the meta base weight (``Cannot copy out of meta tensor``), and a re-dispatch
  hooks adapter containers whose ``forward`` never runs (IA3's ``ia3_l``: a meta vector at the first
  forward).

Here:

* an adapter's tensors follow its base layer's offload hook (:mod:`metapatch._offload.adapter_offload`,
  the one mechanism for every tuner): created next to an onloaded base layer (or, for a plain LoRA
  whose initialisation reads no base value, one stood in for by empty tensors: no disk read),
  placed on the hook's execution device, never hooked themselves, and the base layer onloaded for
  the whole forward of the tuner layer (tuners that read ``base_layer.weight`` directly see its
  value);
* what PEFT writes into an offloaded base layer meanwhile (PiSSA's and OLoRA's residual at creation and
  when a saved adapter re-runs it, a merge, a saved embedding layer or ``modules_to_save`` tensor loaded
  into an offloaded module) is kept for its hook to serve (:mod:`metapatch._offload.store`: an overlay
  in CPU memory in front of the weights map, nothing written), or refused with a ``MetapatchError``
  naming the tensor; a model with nothing offloaded is left to upstream, call for call;
* upstream's re-dispatch is skipped (``hf_device_map`` is hidden from ``from_pretrained`` and
  ``load_adapter`` for the call, so the base keeps its hooks while the adapter is added), and
  metapatch re-dispatches instead: the current placement re-keyed for the wrapper, the offloaded base
  weights read from where accelerate already reads them (nothing is copied or re-saved), ``skip_keys``
  from the model; a map that names only ``disk`` is dispatched with hooks on every accelerate;
* an explicit ``device_map`` (the wrapper's module names, or the base's), the strategies
  ``"balanced"``, ``"balanced_low_0"`` and ``"sequential"``, ``max_memory`` and
  ``offload_dir``/``offload_folder`` are honoured as PEFT documents them, moving only what moves:
  tensors newly sent to disk are written to ``offload_dir`` only (without one they stay in CPU memory,
  with a warning). ``device_map="auto"`` without ``max_memory`` is upstream's own default (what
  ``load_adapter`` uses when no ``device_map`` is given), so, as with no ``device_map``, the base keeps
  its dispatch;
* saving an adapter (``save_pretrained`` of a PEFT model, transformers' adapter save, any caller of
  ``get_peft_model_state_dict``) writes what the in-memory model writes: the base tensors PEFT saves
  beside the adapter (embedding layers, biases) are read, read-only, from where the offload hook
  serves them (:mod:`._saving`), instead of ``meta`` placeholders (``Cannot copy out of meta tensor``);
* ``merge_and_unload`` (and merge/unmerge/unload) work: ``onload_layer`` no longer reads every
  offloaded tensor to look up a file name it never uses (a KeyError with this weights map).

Where the upstream series (``upstream_diffs/peft-offload-redispatch/peft-N-*.diff``) does less, each
measured by ``metapatch diffs check --run`` and pinned by ``tests/patches/test_peft_offload_redispatch_tuners.py``:

* training through an offloaded 4-bit (bitsandbytes) layer: metapatch hangs
  :class:`~metapatch._offload.adapter_offload.KeepQuantStateHook` in front of each such layer's offload hook,
  because offloading the weight after a forward moves the very ``QuantState`` autograd saved to meta
  (``Params4bit.to`` works in place) and the backward then dequantizes garbage. With the series alone
  the nf4 training step's gradients are garbage, NaN or huge (upstream: an error). The fix belongs in bitsandbytes
  (a moved ``Params4bit`` should get its own ``QuantState``), not in peft;
* ``PeftMixedModel.from_pretrained`` over an offloaded base: metapatch wraps it like
  ``PeftModel.from_pretrained``; the series leaves it removing the base's hooks first
  (``AttributeError: ... 'get_base_model'``);
* peft's "only safetensors" check is skipped here (``hf_device_map`` is hidden from the call); the
  series keeps it.
"""

from __future__ import annotations

from metapatch._framework.records import Patch, Target, Upstream

from . import _saving, _wrappers
from ._onload import onload_layer_replacement
from ._placement import _user_map, new_placement  # noqa: F401  (tests and the benchmark use them)
from ._redispatch import redispatch  # noqa: F401
from ._sources import OffloadedTensors, capture_sources  # noqa: F401

PATCH_ID = "peft-offload-redispatch"

# Fingerprints measured per release (peft 0.17.1, 0.18.1, 0.19.1, 0.20.0, 0.21.2, 0.22.0); the reproducers
# pass patched on each (docs: the per-version table in the patch's report).
PATCH = Patch(
    id=PATCH_ID,
    title="PEFT adapters over a cpu/disk-offloaded base: results of the in-memory model for every tuner, the "
          "base placement and checkpoint files kept (no write outside the offload folder), the model's skip_keys",
    # _update_offload (the checkpoint rewrite) and the re-inferred map are both in 0.11.0 onwards;
    # measured from 0.17.1 to 0.22.0 (survey --run, 2026-12-07); not fixed in 0.22.0, the newest release.
    affects={"peft": ">=0.11.0"},
    targets=(
        Target("peft.peft_model", "PeftModel.from_pretrained",
               fingerprints=("6890b79923fbd98e",  # 0.17.1
                             "cca3faebe5bde4c0",  # 0.18.1
                             "c31a288f71d46306",  # 0.19.1
                             "cd5d661cecd68538",  # 0.20.0
                             "fa080cb27757e067",  # 0.21.2
                             "ac6e2eb02964ff10"),  # 0.22.0 (strict_adapter_check, passed on to load_adapter)
               wrapper=_wrappers.from_pretrained),
        Target("peft.mixed_model", "PeftMixedModel.from_pretrained",
               fingerprints=("e197b2200a6d4026",  # 0.17.1
                             "7e08004893d2f7bd",  # 0.18.1-0.21.2
                             "9c48f57d28fdcdaf"),  # 0.22.0 (return annotation only)
               wrapper=_wrappers.from_pretrained),
        Target("peft.peft_model", "PeftModel.load_adapter",
               fingerprints=("d878239f47e8c4bc",  # 0.17.1, 0.18.1
                             "d0b733dc079f68d3",  # 0.19.1
                             "90278732e20e40b5",  # 0.20.0
                             "4c289775b0a6ae1b",  # 0.21.2
                             "bc0e2c51689fc33e"),  # 0.22.0 (strict_adapter_check: warns or raises on key mismatches)
               wrapper=_wrappers.load_adapter),
        Target("peft.tuners.tuners_utils", "BaseTuner.inject_adapter",
               fingerprints=("7aa9350c7b14620b",  # 0.17.1
                             "943651b6895724fe",  # 0.18.1
                             "c128c3d2058942ac",  # 0.19.1, 0.20.0
                             "afced1c19440d2bf",  # 0.21.2
                             "75e827f5d518b910"),  # 0.22.0 (validates every target, then creates the layers)
               wrapper=_wrappers.inject_adapter),
        Target("peft.tuners.tuners_utils", "BaseTunerLayer._move_adapter_to_device_of_base_layer",
               fingerprints=("5055e406d9f1a3db",  # 0.17.1, 0.18.1
                             "38f6dfca25c0f168",  # 0.19.1, 0.20.0
                             "5ae3d49c5476a73f",  # 0.21.2
                             "8e4add5c865eb5ed"),  # 0.22.0 (keeps each moved tensor's requires_grad)
               wrapper=_wrappers.move_adapter),
        Target("peft.tuners.tuners_utils", "onload_layer",
               fingerprints=("613a4d10649c3021",  # 0.17.1-0.19.1
                             "607acfd87f017a8a"),  # 0.20.0, 0.21.2
               replacement=onload_layer_replacement),
        Target("peft.utils.save_and_load", "get_peft_model_state_dict",
               fingerprints=("981886f83747adb0",  # 0.17.x
                             "ee470566ff2dcd8e",  # 0.18.x
                             "1d95bfb5c1856ac0",  # 0.19.x
                             "8aa8635d66fd17a5",  # 0.20.0
                             "2fc7858d1c22444c",  # 0.21.0
                             "d58ad4638396f6ea",  # 0.21.1, 0.21.2
                             "6af2a2197305df5f"),  # 0.22.0 (gathers DTensors of the selected entries; others untouched)
               wrapper=_saving.get_peft_model_state_dict,
               aliases=("peft.utils:get_peft_model_state_dict", "peft.peft_model:get_peft_model_state_dict",
                        "peft:get_peft_model_state_dict", "peft.functional:get_peft_model_state_dict",
                        "peft.tuners.lora.model:get_peft_model_state_dict")),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/peft/issues?q=load_adapter+offload+hf_device_map",
             "https://discuss.huggingface.co/t/cpu-offloading-error-scenario/175522"),
        forwarded="no",
        note="peft: load_adapter keeps the base placement and passes skip_keys; _update_offload writes nothing "
             "outside the offload folder; adapters of offloaded layers follow the base layer's hook",
    ),
)
