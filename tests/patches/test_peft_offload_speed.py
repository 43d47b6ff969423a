"""peft-offload-redispatch's cheaper reads: the helpers that replaced slower upstream calls
give exactly what those calls give. The module walk names the modules ``named_modules`` names, in its
order; a disk layer's tensors read back with the checkpoint opened once equal what accelerate's own
loader reads, tensor for tensor; the declared-ties probe answers what ``getattr`` answers; an
operation's end takes its load watchers off a copied module as before."""

from __future__ import annotations

import copy

import pytest

import metapatch  # noqa: F401 - first: the patches under test
from metapatch._offload.adapter_offload import named_modules
from metapatch._offload.tied_members import _attribute
from metapatch.selftest._models import save_tiny_llama
from metapatch.selftest._peft import offload_map

torch = pytest.importorskip("torch")


def _tree():
    shared = torch.nn.Linear(2, 2)
    root = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), shared))
    root.add_module("again", shared)  # the same module under two names
    root[1].add_module("nothing", None)
    return root


@pytest.mark.parametrize("remove_duplicate", [True, False])
def test_module_walk_is_named_modules(remove_duplicate):
    root = _tree()
    want = [(name, id(module)) for name, module in root.named_modules(remove_duplicate=remove_duplicate)]
    got = [(name, id(module)) for name, module in named_modules(root, remove_duplicate)]
    assert got == want
    assert len(want) == (5 if remove_duplicate else 6)


def test_disk_layer_reads_equal_accelerates_loader(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    import safetensors
    from transformers import AutoModelForCausalLM

    from metapatch.patches.peft_offload_redispatch._redispatch import _sources_by_name
    from metapatch.patches.peft_offload_redispatch._sources import _checkpoint_entry, capture_sources, values_of

    checkpoint = save_tiny_llama(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=offload_map("llama", main="cpu"),
                                                offload_folder=str(tmp_path / "offload"))
    sources = _sources_by_name(base, capture_sources(base))
    names = sorted(sources)
    assert names and all(".layers.2." in n or ".layers.3." in n for n in names)
    want = [sources[name][0][sources[name][1]] for name in names]  # accelerate's loader, one tensor at a time

    opened = []
    real_open = safetensors.safe_open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting_open)
    got = values_of([sources[name] for name in names])
    files = {entry["safetensors_file"] for entry in (_checkpoint_entry(*sources[n]) for n in names) if entry}
    assert sorted(opened) == sorted(files)  # each checkpoint file opened once (transformers 5: the checkpoint)
    for name, a, b in zip(names, want, got):
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), name


def test_declared_ties_probe_is_getattr():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    for attribute in ("all_tied_weights_keys", "get_expanded_tied_weights_keys", "weight", "layers", "absent"):
        for name, module in model.named_modules():
            want, got = getattr(module, attribute, None), _attribute(module, attribute)
            assert got is want or got == want, (name, attribute)
    # not vacuous: the probe answers real attributes too (and the tied head where transformers declares it so)
    assert _attribute(model.model, "layers") is model.model.layers
    if getattr(model, "all_tied_weights_keys", None) is not None:
        assert _attribute(model, "all_tied_weights_keys")


def test_operation_end_removes_watchers_from_a_copy():
    from metapatch._offload import operations

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with operations.Operation("test") as operation:
        operation.watch_loads(model)
        model.add_module("copied", copy.deepcopy(model))  # as PEFT's modules_to_save copies a module
        assert model.copied._load_state_dict_pre_hooks
    assert not model._load_state_dict_pre_hooks and not model.copied._load_state_dict_pre_hooks
    with operations.Operation("test") as operation:
        operation.watch_loads(model)
    assert not model._load_state_dict_pre_hooks


def _module_tensors_by_sets(model, remove_duplicate):
    """The walk ``module_tensors`` replaced: torch's ``named_modules`` plus, for every tuner layer met,
    the ids of every module under its adapter containers (``part.modules()``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapter_modules = set()
    for module_name, module in model.named_modules(remove_duplicate=remove_duplicate):
        if isinstance(module, BaseTunerLayer):
            for attr in tuple(module.adapter_layer_names) + tuple(module.other_param_names):
                part = getattr(module, attr, None)
                if isinstance(part, torch.nn.Module):
                    adapter_modules.update(id(m) for m in part.modules())
        prefix = f"{module_name}." if module_name else ""
        for store in (module._parameters, module._buffers):
            for tensor_name, tensor in store.items():
                if tensor is not None:
                    yield prefix + tensor_name, id(tensor), id(module) in adapter_modules


@pytest.mark.parametrize("tuner", ["lora", "ia3", "vera"])
@pytest.mark.parametrize("remove_duplicate", [True, False])
def test_module_tensors_is_the_walk_it_replaced(tuner, remove_duplicate):
    """The redispatch's one walk flags a tensor as an adapter's exactly where the old definition did, in
    the same order and under the same names, including VeRA's banks shared by every layer."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    from metapatch.patches.peft_offload_redispatch._tensors import module_tensors

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=64, tie_word_embeddings=True)
    targets = ["q_proj", "v_proj"]
    configs = {"lora": lambda: peft.LoraConfig(r=4, target_modules=targets, modules_to_save=["lm_head"]),
               "ia3": lambda: peft.IA3Config(target_modules=targets + ["down_proj"], feedforward_modules=["down_proj"]),
               "vera": lambda: peft.VeraConfig(r=4, target_modules=targets)}
    model = peft.get_peft_model(LlamaForCausalLM(config), configs[tuner]())
    want = list(_module_tensors_by_sets(model, remove_duplicate))
    got = [(name, id(tensor), is_adapter) for name, tensor, is_adapter in module_tensors(model, remove_duplicate)]
    assert got == want
    assert any(flag for _, _, flag in want) and not all(flag for _, _, flag in want)  # both kinds present
    if not remove_duplicate:  # the re-dispatch's walk: every module under its first name, named_modules' order
        from metapatch.patches.peft_offload_redispatch._incremental import _walk

        walk = _walk(model)
        assert [(name, id(module)) for name, module in walk.modules.values()] == \
            [(name, id(module)) for name, module in model.named_modules()]
        assert walk.names == [name for name, _, _ in want]
