from transformers import AutoModelForCausalLM

from _tiny import checkpoint

path = checkpoint()
device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
              "model.norm": "cpu", "lm_head": "cpu"}
model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, offload_folder="offload")
layer = model.model.layers[1].to("cpu")
