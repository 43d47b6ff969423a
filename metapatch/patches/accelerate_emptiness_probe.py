"""accelerate's ``attach_execution_device_hook`` decides whether a module is empty by counting its
tensors instead of calling ``module.state_dict()``.

Serializing a module just to test ``len(...) > 0`` runs every custom ``_save_to_state_dict`` in
the subtree on every dispatch, on modules whose siblings were already offloaded to meta: for
bitsandbytes ``Linear4bit`` that is ``QuantState.as_dict`` -> ``offset.item()`` on a meta tensor
("Tensor.item() cannot be called on meta tensors"). The replacement keeps the upstream body and
changes only the probe; a module counts as non-empty exactly when ``state_dict()`` would hold a
parameter or a persistent buffer.
"""

from __future__ import annotations

from typing import Any, Callable

from metapatch._records import Patch, Target, Upstream


def holds_state_tensors(module: Any) -> bool:
    """True when ``module.state_dict()`` would contain a parameter or persistent buffer."""
    for sub in module.modules():
        if any(p is not None for p in sub._parameters.values()):
            return True
        persistent_off = sub._non_persistent_buffers_set
        if any(b is not None and name not in persistent_off for name, b in sub._buffers.items()):
            return True
    return False


def build_attach_execution_device_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    import accelerate.hooks as hooks

    def attach_execution_device_hook(module, execution_device, skip_keys=None, preload_module_classes=None,
                                     tied_params_map=None):
        if not hasattr(module, "_hf_hook") and holds_state_tensors(module):
            hooks.add_hook_to_module(
                module,
                hooks.AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map),
            )
        if preload_module_classes is not None and module.__class__.__name__ in preload_module_classes:
            return
        for child in module.children():
            # Through the module attribute, as upstream's recursion does: an unpatch takes effect.
            hooks.attach_execution_device_hook(
                child,
                execution_device,
                skip_keys=skip_keys,
                preload_module_classes=preload_module_classes,
                tied_params_map=tied_params_map,
            )

    attach_execution_device_hook.__doc__ = original.__doc__
    attach_execution_device_hook.__wrapped__ = original
    attach_execution_device_hook.__module__ = original.__module__
    attach_execution_device_hook.__qualname__ = original.__qualname__
    return attach_execution_device_hook


PATCH = Patch(
    id="accelerate-emptiness-probe",
    title="accelerate's attach_execution_device_hook counts tensors instead of calling state_dict()",
    # Measured across the support window: bnb-quant-state-offload/dispatch-double-quant fails
    # unpatched with "Tensor.item() cannot be called on meta tensors" (the probe's state_dict())
    # and passes patched on accelerate 1.10.0 (transformers 4.57.1, bitsandbytes 0.46.1), 1.10.1
    # (4.57.6, 0.48.2), 1.11.0 (5.2.0, 0.47.0), 1.12.0 (5.0.0, 0.46.1), 1.13.0 (5.11.0, 0.50.2),
    # 1.14.0 (4.57.6, 0.49.2) and 1.15.0 (5.24.0, 0.50.2). On 1.11.0/1.12.0 with bitsandbytes < 0.50
    # the unpatched dispatch fails first with bnb-params4bit-extra-attributes' TypeError; the probe
    # bug shows with that patch alone on. No release fixes it: upper end open.
    affects={"accelerate": ">=1.10.0"},
    targets=(
        # the same source in accelerate 1.10.0, 1.10.1, 1.11.0, 1.12.0, 1.13.0, 1.14.0 and 1.15.0
        Target("accelerate.hooks", "attach_execution_device_hook", fingerprints=("6496acf3fbf8dc5e",),
               replacement=build_attach_execution_device_hook),
    ),
    upstream=Upstream(
        bug=("https://discuss.huggingface.co/t/cpu-offloading-error-scenario/175522",),
        forwarded="no",
        note="No upstream issue found filed; accelerate 1.15.0 (latest) is affected.",
    ),
)
