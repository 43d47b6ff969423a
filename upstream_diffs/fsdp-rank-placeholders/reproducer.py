"""An evaluation-only model loaded with FSDP cpu_ram_efficient_loading is garbage on rank 1.

Only rank 0 loads the weights; the others hold placeholders (transformers 5.17: zeros; 5.24: the new
`score` head on meta) until an FSDP prepare broadcasts rank 0's state, which
prepare_model(evaluation_mode=True) never does. Two ranks, gloo on CPU; accelerate picks DDP on CPU,
so FSDP is put back as a GPU run would choose it.

Fails with: AssertionError
"""
import os, socket, sys, tempfile  # noqa: E401

import torch
import torch.multiprocessing as mp


def rank_main(rank, port, ckpt):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", ACCELERATE_USE_FSDP="true",
                          FSDP_VERSION="2", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
        from accelerate import Accelerator, PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
        from transformers import AutoModelForSequenceClassification

        plugin = FullyShardedDataParallelPlugin()
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        model = AutoModelForSequenceClassification.from_pretrained(ckpt, num_labels=3).eval()
        model = accelerator.prepare_model(model, evaluation_mode=True)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[1, 5, 9, 3, 7, 2, 4, 6]])).logits
        both = [torch.empty_like(logits) for _ in range(2)]
        torch.distributed.all_gather(both, logits)
        assert torch.equal(both[1], both[0]), f"rank 1's logits differ from rank 0's by {(both[1] - both[0]).abs().max()}"
    finally:  # a clean exit: a rank that leaves its gloo group alive can abort ("terminate called ...")
        torch.distributed.is_initialized() and torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from transformers import LlamaConfig, LlamaForCausalLM

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as ckpt:
        LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).save_pretrained(ckpt)
        try:
            mp.start_processes(rank_main, args=(port, ckpt), nprocs=2, start_method="spawn")
        except mp.ProcessRaisedException as exc:
            sys.exit(str(exc).strip().splitlines()[-1])  # the rank's own error, last
    print("ok: both ranks give the same logits")
