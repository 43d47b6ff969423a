"""Reproducers of reports filed against accelerate's big-model utilities (device maps, dispatch,
checkpoint loading, offload). Each function follows the reporter's code path on a tiny model and
raises when the behaviour is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch
from torch import nn

from _tiny import LLAMA_DISK_MAP, assert_matches, cached, llama, logits, meta_names, offload, tiny_llama_config


def get_module_size_with_ties_prefix(workdir: Path) -> Dict[str, Any]:
    """accelerate#3308: with more than 10 tied layers, ``model.layers.1`` was taken for the module of
    ``model.layers.10.weight`` (a substring test), so the wrong modules were grouped."""
    from accelerate.utils.modeling import get_module_size_with_ties

    n = 15
    tied_params = [f"model.layers.{i}.weight" for i in range(1, n)]
    module_sizes = {**{f"model.layers.{i}": 1000 for i in range(n)}, **{f"model.layers.{i}.weight": 10 for i in range(n)}}
    modules_to_treat = [(f"model.layers.{i}", nn.Linear(2, 2)) for i in range(1, n)]
    _, names, _ = get_module_size_with_ties(tied_params, 1000, module_sizes, modules_to_treat)
    want = [f"model.layers.{i}" for i in range(1, n)]
    if sorted(names) != sorted(want):
        raise AssertionError(f"tied modules found {names}, expected {want}")
    return {"tied_modules": len(names)}


class _SubModule(nn.Module):
    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.parameter = shared

    def forward(self, x: Any) -> Any:
        return x + torch.max(self.parameter)


class _LinearAndSubModule(nn.Linear):
    def __init__(self, features_in: int, features_out: int) -> None:
        super().__init__(features_in, features_out)
        self.weight_submodule = _SubModule(self.weight)


def tied_names_sharing_a_prefix(workdir: Path) -> Dict[str, Any]:
    """accelerate PR #2324: a parameter tied to ``compute.weight_submodule.parameter`` shares the
    prefix ``compute.weight``; the tied group was lost and a small budget raised."""
    from accelerate.utils import infer_auto_device_map

    model = nn.Module()
    model.compute = _LinearAndSubModule(3, 8)
    device_map = infer_auto_device_map(model, max_memory={"cpu": 4, "disk": 10**6})
    devices = {name: device for name, device in device_map.items()}
    if not devices:
        raise AssertionError("no device map computed")
    return {"device_map": {k: str(v) for k, v in devices.items()}}


class _ModelB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3)
        self.layer2 = nn.Linear(3, 3)
        self.layer2.weight = self.layer1.weight
        self.layer2.bias = self.layer1.bias


def tied_parameters_in_one_module(workdir: Path) -> Dict[str, Any]:
    """accelerate#1510: ``infer_auto_device_map`` on a toy model whose two layers share weight and
    bias; the reporter's call raised, and a tight budget must keep the tied layers together."""
    from accelerate.utils import infer_auto_device_map

    model = _ModelB()
    infer_auto_device_map(model, verbose=False)
    tight = infer_auto_device_map(model, max_memory={"cpu": 60, "disk": 10**6})
    placed = {tight.get(name, tight.get("")) for name in ("layer1", "layer2")}
    if len(placed) != 1:
        raise AssertionError(f"tied layer1/layer2 split across {placed}: {tight}")
    return {"device_map": {k: str(v) for k, v in tight.items()}}


def gpt_neox_buffers_on_disk(workdir: Path) -> Dict[str, Any]:
    """accelerate#938: ``init_empty_weights`` + ``load_checkpoint_and_dispatch`` of GPT-NeoX with
    layers on disk; the buffers of disk layers stayed on meta and were moved to the device."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, max_position_embeddings=64,
                           tie_word_embeddings=False)  # GPT-NeoX-20B's head is not tied
    def build(path: Path) -> None:
        # The model's own parameter names: save_pretrained of transformers >= 5.2x writes the head
        # under its legacy name (embed_out) which only from_pretrained maps back; accelerate reads raw keys.
        from safetensors.torch import save_file

        torch.manual_seed(0)
        path.mkdir(parents=True)
        state = GPTNeoXForCausalLM(config).state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))

    ckpt = cached(workdir, "gpt-neox", build)
    with init_empty_weights():
        in_memory = GPTNeoXForCausalLM(config)
    in_memory = load_checkpoint_and_dispatch(in_memory, str(ckpt), device_map={"": "cpu"})
    reference = logits(in_memory.eval())
    with init_empty_weights():
        model = GPTNeoXForCausalLM(config)
    # Everything in memory except decoder layers 1 and 2 (named from the model: the head's name
    # changed across releases).
    device_map = {name: "cpu" for name, _ in model.named_children() if name != "gpt_neox"}
    device_map.update({f"gpt_neox.{name}": "cpu" for name, _ in model.gpt_neox.named_children() if name != "layers"})
    device_map.update({"gpt_neox.layers.0": "cpu", "gpt_neox.layers.1": "disk", "gpt_neox.layers.2": "disk"})
    model = load_checkpoint_and_dispatch(model, str(ckpt), device_map=device_map, offload_folder=offload(workdir))
    return {"max_abs_diff": assert_matches(logits(model.eval()), reference, "GPT-NeoX with layers on disk")}


def base_model_from_causal_lm_checkpoint(workdir: Path) -> Dict[str, Any]:
    """accelerate#2906: ``init_empty_weights`` around ``AutoModel`` (the base model, keys
    ``layers.*``) and ``load_checkpoint_and_dispatch`` with a causal-LM checkpoint (keys
    ``model.layers.*``): nothing matches, the weights stay on meta."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoModel

    ckpt = llama(workdir)
    with init_empty_weights():
        model = AutoModel.from_config(tiny_llama_config())
    model = load_checkpoint_and_dispatch(model, str(ckpt), device_map="auto", offload_folder=offload(workdir))
    left = meta_names(model)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    return {"meta_left": len(left)}


def tied_weights_missing_from_checkpoint(workdir: Path) -> Dict[str, Any]:
    """accelerate#1289: ``load_checkpoint_and_dispatch`` of a model with tied embeddings whose
    checkpoint has no ``lm_head.weight`` (``weight is on the meta device, we need a value``)."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import LlamaForCausalLM

    ckpt = llama(workdir, tie=True)
    reference = logits(LlamaForCausalLM.from_pretrained(ckpt).eval())
    from transformers import AutoModelForCausalLM

    with init_empty_weights():  # the documented big-model recipe, without model.tie_weights()
        model = AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True))
    model = load_checkpoint_and_dispatch(model, str(ckpt), device_map=LLAMA_DISK_MAP, offload_folder=offload(workdir),
                                         no_split_module_classes=["LlamaDecoderLayer"])
    return {"max_abs_diff": assert_matches(logits(model.eval()), reference, "tied Llama dispatched from its checkpoint")}


def disk_offload_of_offloaded_model(workdir: Path) -> Dict[str, Any]:
    """accelerate#2129: ``disk_offload(model, offload_dir)`` on a model whose layers are already
    offloaded: ``state_dict()`` holds meta placeholders and copying them fails."""
    from accelerate import disk_offload
    from transformers import LlamaForCausalLM

    ckpt = llama(workdir)
    reference = logits(LlamaForCausalLM.from_pretrained(ckpt).eval())
    model = LlamaForCausalLM.from_pretrained(ckpt, device_map=LLAMA_DISK_MAP, offload_folder=offload(workdir)).eval()
    model = disk_offload(model, offload_dir=offload(workdir, "second-offload"))
    return {"max_abs_diff": assert_matches(logits(model), reference, "model disk-offloaded twice")}


def cpu_of_offloaded_model(workdir: Path) -> Dict[str, Any]:
    """accelerate#3866: ``.cpu()`` on a model loaded with a device map that offloads layers: raw
    ``Cannot copy out of meta tensor``. Fixed means a clear refusal that names the offloading, and
    the model still computes the in-memory reference."""
    from transformers import LlamaForCausalLM

    ckpt = llama(workdir)
    reference = logits(LlamaForCausalLM.from_pretrained(ckpt).eval())
    model = LlamaForCausalLM.from_pretrained(ckpt, device_map=LLAMA_DISK_MAP, offload_folder=offload(workdir)).eval()
    outcome = "moved"
    try:
        model.cpu()
    except Exception as exc:  # noqa: BLE001 - judged below
        text = str(exc)
        if "offload" not in text or "device_map" not in text:
            raise
        outcome = type(exc).__name__
    return {"move": outcome, "max_abs_diff": assert_matches(logits(model), reference, "after .cpu()")}


def rotary_buffer_after_to_empty(workdir: Path) -> Dict[str, Any]:
    """transformers#34234: Llama built with ``init_empty_weights()``, moved with ``to_empty()`` and
    loaded with ``load_checkpoint_and_dispatch``: ``inv_freq`` (non-persistent, in no checkpoint)
    holds the memory ``to_empty`` gave it (filled with NaN here, so the result is deterministic)."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import LlamaForCausalLM

    from metapatch.selftest._models import nan_sentinel

    ckpt = llama(workdir)
    reference = logits(LlamaForCausalLM.from_pretrained(ckpt).eval())
    with init_empty_weights():
        model = LlamaForCausalLM(tiny_llama_config())
    with nan_sentinel():
        model.to_empty(device="cpu")
    model = load_checkpoint_and_dispatch(model, str(ckpt), device_map={"": "cpu"}).eval()
    return {"max_abs_diff": assert_matches(logits(model), reference, "Llama after init_empty_weights, to_empty and load_checkpoint_and_dispatch")}
