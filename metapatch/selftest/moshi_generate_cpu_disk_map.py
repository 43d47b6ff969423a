"""Reproducers for moshi-generate-cpu-disk-map: Moshi's ``generate`` over a device map without an accelerator.

A tiny random ``MoshiForConditionalGeneration`` (its Mimi audio codec, the text decoder and the depth decoder) is
saved; the reference is the in-memory model. The same checkpoint is loaded with a real
``from_pretrained(device_map=..., offload_folder=...)``: the depth decoder on disk, the rest on ``cpu``, as a
machine without a GPU offloads it. Both generate three steps greedily from the same text tokens and user / Moshi
audio codes, returning the text tokens, the audio codes and the decoded waveforms. Fixed means all three equal the
in-memory model's (torch.equal) and the checkpoint and offload folder are as the load left them. Upstream every
``generate`` fails where it looks for the map's first accelerator: ``IndexError: list index out of range``.

The scenario computes on the CPU on every machine: the bug is a map without an accelerator, and such a map computes
on the CPU (a GPU machine's map names its GPU, where upstream works).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._harness import Scenario

PATCH_ID = "moshi-generate-cpu-disk-map"
_CODEBOOKS = 4
_CODEBOOK_SIZE = 64
_CPU_ONLY = ("the bug is a device map without an accelerator (cpu/disk offload on a machine without a GPU): such a "
             "map computes on the CPU on any machine")
OUTPUTS = ("sequences", "audio_codes", "audio_sequences")


def save_tiny_moshi(path: Path) -> Path:
    import torch
    from transformers import MimiConfig, MoshiConfig, MoshiForConditionalGeneration

    mimi = MimiConfig(hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[8, 4],
                      codebook_size=_CODEBOOK_SIZE, vector_quantization_hidden_dimension=16, upsample_groups=16,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, sliding_window=4,
                      codebook_dim=16, use_cache=False, num_quantizers=_CODEBOOKS, num_semantic_quantizers=1,
                      intermediate_size=32, head_dim=8)
    config = MoshiConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=8, ffn_dim=64, num_codebooks=_CODEBOOKS,
                         audio_encoder_config=mimi.to_dict(),
                         depth_decoder_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                   num_key_value_heads=2, head_dim=8, ffn_dim=32, sliding_window=4))
    torch.manual_seed(0)
    MoshiForConditionalGeneration(config).save_pretrained(path)
    return path


def _files(folder: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _generate(model: Any) -> Dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(1)
    codes = [torch.randint(0, _CODEBOOK_SIZE, (1, _CODEBOOKS, 3), generator=generator) for _ in range(2)]
    output = model.generate(input_ids=torch.tensor([[1, 2, 3]]), user_audio_codes=codes[0],
                            moshi_audio_codes=codes[1], max_new_tokens=3, do_sample=False,
                            return_audio_waveforms=True, return_audio_codes=True)
    return {name: getattr(output, name) for name in OUTPUTS}


def cpu_disk_map(workdir: Path) -> Dict[str, Any]:
    import torch
    from transformers import MoshiForConditionalGeneration

    checkpoint = save_tiny_moshi(workdir / "moshi")
    expected = _generate(MoshiForConditionalGeneration.from_pretrained(checkpoint).eval())
    before = _files(checkpoint)
    device_map = {"embed_tokens": "cpu", "audio_encoder": "cpu", "decoder": "cpu", "depth_decoder": "disk"}
    model = MoshiForConditionalGeneration.from_pretrained(checkpoint, device_map=device_map,
                                                          offload_folder=str(workdir / "offload")).eval()
    if not any(param.is_meta for param in model.depth_decoder.parameters()):
        raise AssertionError("the depth decoder was not offloaded: the scenario would prove nothing")
    offloaded = _files(workdir / "offload") if (workdir / "offload").exists() else {}
    got = _generate(model)
    for name in OUTPUTS:
        if not torch.equal(got[name], expected[name]):
            raise AssertionError(f"generate's {name} differ from the in-memory model's")
    if _files(checkpoint) != before or (_files(workdir / "offload") if (workdir / "offload").exists() else {}) \
            != offloaded:
        raise AssertionError("the checkpoint or the offload folder changed")
    return {"max_abs_diff": 0.0, "generated_tokens": int(got["sequences"].shape[-1]),
            "devices": sorted(set(model.hf_device_map.values()) | {"disk"})}


SCENARIOS = [
    Scenario(PATCH_ID, "cpu-disk-map", f"{__name__}:cpu_disk_map",
             "a tiny Moshi with its depth decoder on disk and the rest on cpu: generate's text tokens, audio codes and "
             "waveforms equal the in-memory model's (unpatched: IndexError where generate looks for the map's first "
             "accelerator)",
             expected_error="IndexError", expected_message="list index out of range", quick=True,
             device="cpu", device_reason=_CPU_ONLY),
]
