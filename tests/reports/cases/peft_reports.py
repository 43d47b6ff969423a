"""Reproducers of reports about PEFT adapters over a base model with offloaded layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch

from _tiny import LLAMA_DISK_MAP, NotApplicable, assert_matches, cached, greedy, llama, logits, offload

TARGETS = ["q_proj", "v_proj"]


def _lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, task_type="CAUSAL_LM")


def _base(ckpt: Path, workdir: Path = None, **kwargs: Any) -> Any:
    from transformers import LlamaForCausalLM

    if workdir is not None:
        kwargs = dict(device_map=LLAMA_DISK_MAP, offload_folder=offload(workdir), **kwargs)
    return LlamaForCausalLM.from_pretrained(ckpt, **kwargs).eval()


def _adapter(workdir: Path, ckpt: Path) -> Path:
    """A LoRA adapter with non-zero weights on every layer, saved from the in-memory base."""
    from peft import get_peft_model

    def build(path: Path) -> None:
        torch.manual_seed(1)
        get_peft_model(_base(ckpt), _lora_config()).save_pretrained(path)

    return cached(workdir, "adapter", build)


def _reference(workdir: Path) -> tuple:
    from peft import PeftModel

    ckpt = llama(workdir)
    adapter = _adapter(workdir, ckpt)
    return ckpt, adapter, logits(PeftModel.from_pretrained(_base(ckpt), adapter).eval())


def peft_from_pretrained_over_offloaded(workdir: Path) -> Dict[str, Any]:
    """alpaca-lora#368: ``PeftModel.from_pretrained`` over a base that ``device_map`` offloaded."""
    from peft import PeftModel

    ckpt, adapter, reference = _reference(workdir)
    model = PeftModel.from_pretrained(_base(ckpt, workdir), adapter).eval()
    return {"max_abs_diff": assert_matches(logits(model), reference, "LoRA over an offloaded base")}


def peft_offload_dir_keyword(workdir: Path) -> Dict[str, Any]:
    """peft#774: the reporter passes ``offload_dir=`` to ``PeftModel.from_pretrained`` (the base was
    loaded with ``offload_folder=``) and expects the adapter to load over the offloaded base."""
    from peft import PeftModel

    ckpt, adapter, reference = _reference(workdir)
    model = PeftModel.from_pretrained(_base(ckpt, workdir), adapter, offload_dir=offload(workdir, "peft-offload")).eval()
    return {"max_abs_diff": assert_matches(logits(model), reference, "LoRA loaded with offload_dir")}


def merge_and_unload_offloaded(workdir: Path) -> Dict[str, Any]:
    """peft#868: base and adapter loaded with ``device_map`` + ``offload_folder``, then
    ``merge_and_unload()`` and ``save_pretrained``: the saved model must equal the in-memory merge."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    ckpt, adapter, _ = _reference(workdir)
    merged_reference = logits(PeftModel.from_pretrained(_base(ckpt), adapter).merge_and_unload().eval())
    model = PeftModel.from_pretrained(_base(ckpt, workdir), adapter, device_map=LLAMA_DISK_MAP,
                                      offload_folder=offload(workdir))
    merged = model.merge_and_unload()
    merged.save_pretrained(workdir / "merged")
    reloaded = LlamaForCausalLM.from_pretrained(workdir / "merged").eval()
    return {"max_abs_diff": assert_matches(logits(reloaded), merged_reference, "merged, saved and reloaded")}


def get_peft_model_over_offloaded(workdir: Path) -> Dict[str, Any]:
    """peft#2834 (PR #2836): ``get_peft_model`` on an offloaded base moves new adapter weights to
    the base layer's device, which is meta for offloaded layers."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    ckpt = llama(workdir)
    torch.manual_seed(1)
    in_memory = get_peft_model(_base(ckpt), _lora_config()).eval()
    reference = logits(in_memory)
    model = get_peft_model(_base(ckpt, workdir), _lora_config())
    set_peft_model_state_dict(model, get_peft_model_state_dict(in_memory))
    return {"max_abs_diff": assert_matches(logits(model.eval()), reference, "get_peft_model over an offloaded base")}


def transformers_load_adapter_over_offloaded(workdir: Path) -> Dict[str, Any]:
    """transformers#33744: transformers' own ``model.load_adapter(path)`` (``PeftAdapterMixin``, not
    ``PeftModel``) on a base whose layers are offloaded."""
    ckpt, adapter, reference = _reference(workdir)
    model = _base(ckpt, workdir)
    model.load_adapter(str(adapter))
    return {"max_abs_diff": assert_matches(logits(model), reference, "model.load_adapter over an offloaded base")}


def prefix_tuning_cpu_disk_map(workdir: Path) -> Dict[str, Any]:
    """peft#3619: prefix tuning (``get_peft_model`` with ``PrefixTuningConfig``, the adapter's state loaded) over a
    base whose ``hf_device_map`` names only cpu and disk, as a machine without a GPU offloads: peft looks for the
    map's accelerator to place the virtual-token cache at every forward."""
    import peft
    from packaging.version import Version
    from peft import PrefixTuningConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    if Version(peft.__version__) < Version("0.18"):
        raise NotApplicable("peft 0.17 fails prefix tuning over any device map on transformers >= 4.56 first "
                            "('DynamicCache' object has no attribute 'key_cache'; fixed in peft 0.18)")
    ckpt = llama(workdir)
    config = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    torch.manual_seed(1)
    in_memory = get_peft_model(_base(ckpt), config).eval()
    model = get_peft_model(_base(ckpt, workdir), config)
    set_peft_model_state_dict(model, get_peft_model_state_dict(in_memory))
    model.eval()
    diff = assert_matches(logits(model), logits(in_memory), "prefix tuning over a cpu/disk map")
    tokens, expected = greedy(model), greedy(in_memory)
    if not torch.equal(tokens, expected):
        raise AssertionError(f"generate gave {tokens.tolist()}, in memory {expected.tolist()}: differ from the in-memory reference")
    return {"max_abs_diff": diff}
