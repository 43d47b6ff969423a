"""peft 0.19 cannot load a LoRA adapter while a process group is running (transformers >= 5.16).

set_peft_model_state_dict imports EmbeddingParallel from transformers' tensor_parallel whenever
torch.distributed is initialised, before looking for tensor-parallel layers; transformers 5.16
removed the name. Two ranks, gloo on CPU, PeftModel.from_pretrained on each.

Fails with: ImportError
"""
import os, socket, sys, tempfile  # noqa: E401

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    try:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(f"{out}/ckpt"), f"{out}/adapter")
        torch.save(model(input_ids=torch.arange(8)[None]).logits.detach(), f"{out}/{rank}")
    except Exception as exc:
        torch.save(f"{type(exc).__name__}: {exc}", f"{out}/{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4)).save_pretrained(f"{out}/ckpt")
        get_peft_model(AutoModelForCausalLM.from_pretrained(f"{out}/ckpt"),
                       LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(f"{out}/adapter")
        expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(f"{out}/ckpt"), f"{out}/adapter")
        expected = expected(input_ids=torch.arange(8)[None]).logits.detach()
        mp.start_processes(rank_main, args=(port, out), nprocs=2, start_method="spawn")
        results = [torch.load(f"{out}/{r}") for r in range(2)]
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        sys.exit(errors[0])
    for logits in results:
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    print("ok: every rank equals one process")
