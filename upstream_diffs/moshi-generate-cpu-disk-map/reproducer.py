"""Moshi's generate fails when the model's device map names no accelerator.

A tiny MoshiForConditionalGeneration with its depth decoder on disk and the rest on "cpu" (a machine without a
GPU): generate looks for the map's first device other than cpu/disk to give the depth decoder a map of its own,
and finds none.

Fails with: IndexError
"""
import tempfile

import torch
from transformers import MimiConfig, MoshiConfig, MoshiForConditionalGeneration

mimi = MimiConfig(hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[8, 4], codebook_size=64,
                  vector_quantization_hidden_dimension=16, upsample_groups=16, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, sliding_window=4, codebook_dim=16, use_cache=False,
                  num_quantizers=4, num_semantic_quantizers=1, intermediate_size=32, head_dim=8)
config = MoshiConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=8, ffn_dim=64, num_codebooks=4, audio_encoder_config=mimi.to_dict(),
                     depth_decoder_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                               num_key_value_heads=2, head_dim=8, ffn_dim=32, sliding_window=4))
inputs = dict(input_ids=torch.tensor([[1, 2, 3]]), user_audio_codes=torch.randint(0, 64, (1, 4, 3)),
              moshi_audio_codes=torch.randint(0, 64, (1, 4, 3)), max_new_tokens=3, do_sample=False,
              return_audio_waveforms=False)
with tempfile.TemporaryDirectory() as folder:
    torch.manual_seed(0)
    MoshiForConditionalGeneration(config).save_pretrained(folder)
    expected = MoshiForConditionalGeneration.from_pretrained(folder).eval().generate(**inputs)
    device_map = {"embed_tokens": "cpu", "audio_encoder": "cpu", "decoder": "cpu", "depth_decoder": "disk"}
    model = MoshiForConditionalGeneration.from_pretrained(folder, device_map=device_map,
                                                          offload_folder=f"{folder}/offload").eval()
    got = model.generate(**inputs)
    assert torch.equal(got, expected), (got, expected)
print("ok")
