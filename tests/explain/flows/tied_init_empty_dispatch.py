import torch
from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from transformers import AutoConfig, AutoModelForCausalLM

from _tiny import REST_ON_CPU, checkpoint

path = checkpoint(tie=True)
config = AutoConfig.from_pretrained(path)
with init_empty_weights():
    model = AutoModelForCausalLM.from_config(config)
device_map = {"model.embed_tokens": "cpu", **REST_ON_CPU, "lm_head": "cpu"}
model = load_checkpoint_and_dispatch(model, path, device_map=device_map, offload_folder="offload")
logits = model(torch.tensor([[1, 2, 3, 4]])).logits
