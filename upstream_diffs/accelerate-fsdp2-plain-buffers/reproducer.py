"""FSDP2 with cpu_ram_efficient_loading fails on any model with a persistent buffer.

fsdp2_load_full_state_dict reads `.device_mesh` of every state-dict entry, but fully_shard leaves
buffers as plain tensors (BART's final_logits_bias, MoE gates' e_score_correction_bias). Two ranks,
gloo on CPU; accelerate picks DDP on CPU, so FSDP is put back as a GPU run would choose it.

Fails with: AttributeError
"""
import os, socket, sys, tempfile  # noqa: E401

import torch
import torch.multiprocessing as mp
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("bias", torch.arange(8.0))  # persistent, not a parameter

    def forward(self, x):
        return self.proj(x) + self.bias


def rank_main(rank, port, out):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
        from accelerate import Accelerator, PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        torch.manual_seed(0)
        model, x = Gate(), torch.randn(2, 8)
        expected = model(x).detach()
        try:
            model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # .device_mesh
            torch.testing.assert_close(model(x), expected)
            torch.save(None, f"{out}/{rank}")
        except Exception as exc:
            torch.save(f"{type(exc).__name__}: {exc}", f"{out}/{rank}")
    finally:  # a clean exit: a rank that leaves its gloo group alive can abort ("terminate called ...")
        torch.distributed.is_initialized() and torch.distributed.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(port, out), nprocs=2, start_method="spawn")
        errors = [e for e in (torch.load(f"{out}/{r}") for r in range(2)) if e]
    if errors:
        sys.exit(errors[0])
    print("ok: every rank equals one process")
