import torch
from transformers import AutoModelForCausalLM

from _tiny import REST_ON_CPU, checkpoint

path = checkpoint()
device_map = {"model.embed_tokens": "cpu", **REST_ON_CPU, "lm_head": "disk"}
model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, offload_folder="offload")
model = model.to(torch.float16)
