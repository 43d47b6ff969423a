"""Reproducers of reports involving bitsandbytes 4-bit layers, gguf's lazy tensors, and the GPU-only
reports (int8 CPU offload, adapters on a second GPU). The CPU ones reuse metapatch's shipped
reproducers, which were written from these very reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch


def peft_over_offloaded_double_quant(workdir: Path) -> Dict[str, Any]:
    """discuss.huggingface.co thread 175522: PEFT over a 4-bit nf4 double-quant model with offloaded
    parts; dispatch asks ``Linear4bit`` for ``state_dict()`` and ``offset.item()`` meets meta."""
    from metapatch.selftest.bnb_quant_state_offload import peft_lora_over_offloaded

    return peft_lora_over_offloaded(workdir)


def params4bit_extra_attributes(workdir: Path) -> Dict[str, Any]:
    """bitsandbytes PR #1900: dispatching a 4-bit model loaded by transformers 5 passes the
    parameter's ``__dict__`` (with ``_is_hf_initialized``) to ``Params4bit.__new__``."""
    from metapatch.selftest.bnb_params4bit_extra_attributes import dispatch_as_loaded

    return dispatch_as_loaded(workdir)


def gguf_lazy_bitnet(workdir: Path) -> Dict[str, Any]:
    """llama.cpp#25629: ``convert_hf_to_gguf.py`` on BitNet: an eager shift tensor meets a lazy one."""
    from metapatch.selftest.gguf_lazy_eager_mix import lazy_unpack_matches_eager

    return lazy_unpack_matches_eager(workdir)


def _needs_cuda(count: int = 1) -> None:
    from metapatch.selftest import NotApplicable

    if not torch.cuda.is_available() or torch.cuda.device_count() < count:
        raise NotApplicable(f"needs {count} CUDA device(s)")


def int8_fp32_cpu_offload(workdir: Path) -> Dict[str, Any]:
    """transformers#22018: ``load_in_8bit`` + ``llm_int8_enable_fp32_cpu_offload`` with a map that
    puts the last layers on cpu: the int8 layers live on the GPU, the rest runs in fp32 on cpu."""
    _needs_cuda()
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    from _tiny import input_ids, llama

    ckpt = llama(workdir)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": "cpu", "model.layers.3": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=True)
    model = LlamaForCausalLM.from_pretrained(ckpt, device_map=device_map, quantization_config=config).eval()
    with torch.no_grad():
        out = model(input_ids().to(0)).logits
    if not torch.isfinite(out).all():
        raise AssertionError("int8 with fp32 cpu offload produced non-finite logits")
    return {"logits_shape": list(out.shape)}


def adapter_on_second_gpu(workdir: Path) -> Dict[str, Any]:
    """peft#2787: ``PeftModel.from_pretrained`` of a base on ``cuda:1`` must apply the adapter there."""
    _needs_cuda(2)
    from peft import PeftModel
    from peft_reports import _adapter, _base

    from _tiny import assert_matches, llama, logits

    ckpt = llama(workdir)
    adapter = _adapter(workdir, ckpt)
    reference = logits(PeftModel.from_pretrained(_base(ckpt), adapter).eval())
    model = PeftModel.from_pretrained(_base(ckpt, device_map={"": 1}), adapter).eval()
    with torch.no_grad():
        from _tiny import input_ids

        got = model(input_ids().to("cuda:1")).logits.cpu()
    return {"max_abs_diff": assert_matches(got, reference, "adapter on cuda:1", tolerance=1e-3)}
