"""BART through accelerate's FSDP2 prepare: torch >= 2.13 refuses the shared weight, older torch mis-trains it.

`shared.weight` is also both `embed_tokens.weight` and the `lm_head`; fsdp2_prepare_model groups the
input and output embeddings, the two `embed_tokens` stay in the root group. Two ranks, gloo on CPU
(FSDP put back over accelerate's CPU choice of DDP); logits before/after one SGD step vs one process.

Fails with: ValueError|AssertionError
"""
import os, socket, sys, tempfile  # noqa: E401

import torch
import torch.multiprocessing as mp
from transformers import BartConfig, BartForConditionalGeneration


def forward_step_forward(model, ids, backward, optimizer):
    logits = [model(input_ids=ids, decoder_input_ids=ids).logits.detach()]  # torch >= 2.13 checks groups here
    backward(model(input_ids=ids, decoder_input_ids=ids, labels=ids).loss)
    optimizer.step()
    return logits + [model(input_ids=ids, decoder_input_ids=ids).logits.detach()]


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    model = BartForConditionalGeneration.from_pretrained(f"{out}/ckpt")
    try:
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        got = forward_step_forward(model, torch.arange(3, 11)[None], accelerator.backward, optimizer)
        for logits, expected in zip(got, torch.load(f"{out}/expected")):  # FSDP2 averages the ranks' gradients
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
        torch.save(None, f"{out}/{rank}")
    except Exception as exc:
        torch.save(f"{type(exc).__name__}: {' '.join(str(exc).split())}", f"{out}/{rank}")  # one line


if __name__ == "__main__":
    with socket.socket() as sock:
        port = sock.bind(("127.0.0.1", 0)) or sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        torch.manual_seed(0)
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)).eval()
        model.save_pretrained(f"{out}/ckpt")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.save(forward_step_forward(model, torch.arange(3, 11)[None], torch.Tensor.backward, optimizer),
                   f"{out}/expected")
        mp.start_processes(rank_main, args=(port, out), nprocs=2, start_method="spawn")
        errors = [e for e in (torch.load(f"{out}/{r}") for r in range(2)) if e]
    if errors:
        sys.exit(errors[0])
    print("ok: every rank equals one process")
