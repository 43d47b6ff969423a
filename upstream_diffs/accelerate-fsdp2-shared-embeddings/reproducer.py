"""BART through accelerate's FSDP2 prepare fails torch's shared-parameter check (torch >= 2.13).

`shared.weight` is also the encoder's and the decoder's `embed_tokens.weight` and the `lm_head`;
fsdp2_prepare_model groups the input and output embeddings but leaves the two `embed_tokens` to the
root group. Two ranks, gloo on CPU; accelerate picks DDP on CPU, so FSDP is put back as a GPU run
would choose it.

Fails with: ValueError
"""
import os, socket, sys, tempfile  # noqa: E401

import torch
import torch.multiprocessing as mp


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import BartForConditionalGeneration

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    model = BartForConditionalGeneration.from_pretrained(f"{out}/ckpt")
    ids = torch.arange(3, 11)[None]
    try:
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with torch.no_grad():
            logits = model(input_ids=ids, decoder_input_ids=ids).logits  # torch checks the groups here
        torch.testing.assert_close(logits, torch.load(f"{out}/expected"), rtol=0, atol=1e-6)
        torch.save(None, f"{out}/{rank}")
    except Exception as exc:
        torch.save(f"{type(exc).__name__}: {exc}", f"{out}/{rank}")


if __name__ == "__main__":
    from transformers import BartConfig, BartForConditionalGeneration

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        torch.manual_seed(0)
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)).eval()
        ids = torch.arange(3, 11)[None]
        with torch.no_grad():
            torch.save(model(input_ids=ids, decoder_input_ids=ids).logits, f"{out}/expected")
        model.save_pretrained(f"{out}/ckpt")
        mp.start_processes(rank_main, args=(port, out), nprocs=2, start_method="spawn")
        errors = [e for e in (torch.load(f"{out}/{r}") for r in range(2)) if e]
    if errors:
        sys.exit(errors[0])
    print("ok: every rank equals one process")
