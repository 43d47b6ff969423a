"""save_fsdp_model(adapter_only=True) with FSDP2 and FULL_STATE_DICT writes rank 0's shard only.

A LoRA (r=4) over a tiny Llama, prepared with FSDP2 on two ranks (gloo on CPU; accelerate picks DDP
on CPU, so FSDP is put back as a GPU run would choose it), saved the way Trainer saves FSDP
checkpoints: the file must hold the full adapter, equal to the one-process adapter tensor by tensor.
On accelerate 1.13-1.14 each entry is a pickled DTensor holding rank 0's (2, 64) half of a (4, 64) lora_A.

Fails with: AssertionError
"""
import os, socket, tempfile  # noqa: E401

import torch
import torch.multiprocessing as mp


def lora(path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(3)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, save_fsdp_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="FULL_STATE_DICT")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    model = lora(f"{out}/ckpt")
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    save_fsdp_model(plugin, accelerator, model, f"{out}/saved", adapter_only=True)


if __name__ == "__main__":
    from peft import get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4)).save_pretrained(f"{out}/ckpt")
        expected = get_peft_model_state_dict(lora(f"{out}/ckpt"))
        mp.start_processes(rank_main, args=(port, out), nprocs=2, start_method="spawn")
        saved = torch.load(f"{out}/saved/pytorch_model_fsdp.bin", weights_only=False)
        for key, value in expected.items():
            got = saved.get(key, saved.get(key.replace(".weight", ".default.weight")))  # 1.15: the model's names
            local = got.to_local() if hasattr(got, "to_local") else got  # what a reader outside the group gets
            assert local.shape == value.shape and torch.equal(local, value), \
                f"{key}: saved {tuple(local.shape)}, expected {tuple(value.shape)}"
    print("ok: the saved adapter equals one process's")
