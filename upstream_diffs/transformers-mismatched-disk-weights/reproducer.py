"""A new classification head mapped to disk gets the checkpoint's head of the old shape.

`from_pretrained(..., num_labels=2, ignore_mismatched_sizes=True)` over a checkpoint saved with 5 labels
initializes a new `score` in memory. With `score` on disk, transformers keeps the disk offload index entry that
points at the checkpoint's `[5, H]` head, never initializes the new one, and the offload hook loads the old head
into the `[2, H]` layer at the first forward.

Fails with: ValueError
Affected: transformers-mismatched-disk-weights
"""
import tempfile

import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_labels=5, pad_token_id=0)
device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers": "cpu", "model.norm": "cpu",
              "score": "disk"}
ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(1))
with tempfile.TemporaryDirectory() as tmp:
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(tmp)
    torch.manual_seed(7)
    in_memory = AutoModelForSequenceClassification.from_pretrained(tmp, num_labels=2, ignore_mismatched_sizes=True)
    torch.manual_seed(7)
    offloaded = AutoModelForSequenceClassification.from_pretrained(
        tmp, num_labels=2, ignore_mismatched_sizes=True, device_map=device_map, offload_folder=f"{tmp}/offload")
    with torch.no_grad():
        logits = offloaded(ids).logits  # without the fix: ValueError: Trying to set a tensor of shape [5, 64] ...
        expected = in_memory(ids).logits
# with the same seed, the new head is initialized with the same values on both paths (on the CPU)
assert torch.equal(logits, expected), f"{logits} != in-memory {expected}"
print("ok: the offloaded model's new head is initialized as in memory")
