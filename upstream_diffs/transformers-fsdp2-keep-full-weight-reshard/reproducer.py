"""An optimizer built after an evaluation forward of a model transformers sharded with FSDP2 never
updates the final norm and lm_head.

from_pretrained(distributed_config=DistributedConfig(fsdp_size=2)) keeps norm + lm_head unsharded
after a forward (keep_full_weight); after a no_grad forward, model.parameters() yields those full
tensors, which get no gradient. Two ranks, gloo on CPU; the reference is the same loop in one process.

Fails with: AssertionError
"""
import importlib.util, os, socket, sys, tempfile  # noqa: E401

import torch
import torch.multiprocessing as mp

if importlib.util.find_spec("transformers.distributed.fsdp") is None:  # before 5.14: no native FSDP2
    raise SystemExit(print("n/a: this transformers has no distributed_config FSDP2 loading") or 77)

IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 4, 6]])


def eval_then_step(model):
    model.eval()
    with torch.no_grad():
        model(input_ids=IDS)  # an evaluation before training
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def rank_main(rank, port, ckpt, expected):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(ckpt, distributed_config=DistributedConfig(fsdp_size=2))
    diff = float((eval_then_step(model) - expected).abs().max())
    assert diff <= 1e-5, f"rank {rank}: logits after one step differ from one process's by {diff}"


if __name__ == "__main__":
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(ckpt)
        expected = eval_then_step(AutoModelForCausalLM.from_pretrained(ckpt))
        try:
            mp.start_processes(rank_main, args=(port, ckpt, expected), nprocs=2, start_method="spawn")
        except mp.ProcessRaisedException as exc:
            sys.exit(str(exc).strip().splitlines()[-1])  # the rank's own error, last
    print("ok: both ranks equal one process after the step")
