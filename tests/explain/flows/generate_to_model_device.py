import torch
from transformers import AutoModelForCausalLM

from _tiny import REST_ON_CPU, checkpoint

path = checkpoint()
device_map = {"model.embed_tokens": "disk", **REST_ON_CPU, "lm_head": "cpu"}
model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, offload_folder="offload")
inputs = {"input_ids": torch.tensor([[1, 2, 3, 4]])}
inputs = {k: v.to(model.device) for k, v in inputs.items()}
out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
