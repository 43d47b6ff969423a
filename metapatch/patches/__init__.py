"""One module per patch; each defines ``PATCH``, a :class:`metapatch.Patch`. Modules here must
stay import-cheap: anything from torch or the Hugging Face stack is imported inside functions."""

# patch id -> (module or package in this folder, the modules its targets live in). `import metapatch`
# registers its import hooks from this table alone and imports a patch module only when one of its
# target modules is imported (or `metapatch status` asks), which keeps `import metapatch` cheap.
# Generated from the records: `python -m metapatch.patches --write` (tests/test_registry.py fails when
# it is out of date). A patch module missing here is simply loaded at `import metapatch`: never a lost patch.
INDEX = {
    'accelerate-dispatch-skip-keys': ('accelerate_dispatch_skip_keys', ('accelerate.big_modeling',)),
    'accelerate-emptiness-probe': ('accelerate_emptiness_probe', ('accelerate.hooks',)),
    'accelerate-fsdp2-adapter-state': ('accelerate_fsdp2_adapter_state', ('accelerate.utils.fsdp_utils',)),
    'accelerate-fsdp2-plain-buffers': ('accelerate_fsdp2_plain_buffers', ('accelerate.utils.fsdp_utils',)),
    'accelerate-fsdp2-shared-embeddings': ('accelerate_fsdp2_shared_embeddings', ('accelerate.utils.fsdp_utils',)),
    'accelerate-redispatch-guard': ('accelerate_redispatch_guard', ('accelerate.big_modeling',)),
    'accelerate-root-disk-map': ('accelerate_root_disk_map', ('accelerate.utils.offload',)),
    'accelerate-tie-before-load': ('accelerate_tie_before_load', ('accelerate.big_modeling', 'accelerate.utils.modeling')),
    'accelerate-unindexed-disk-tensors': ('accelerate_unindexed_disk_tensors', ('accelerate.big_modeling',)),
    'bnb-cpu-repack-copy': ('bnb_cpu_repack_copy', ('bitsandbytes.nn.modules',)),
    'bnb-params4bit-extra-attributes': ('bnb_params4bit_extra_attributes', ('bitsandbytes.nn.modules',)),
    'bnb-quant-state-offload': ('bnb_quant_state_offload', ('bitsandbytes.functional', 'bitsandbytes.nn.modules')),
    'diffusion-gemma-offloaded-embeddings': ('diffusion_gemma_offloaded_embeddings', ('transformers.models.diffusion_gemma.modeling_diffusion_gemma',)),
    'empty-built-nonpersistent-buffers': ('empty_built_nonpersistent_buffers', ('transformers.modeling_utils',)),
    'empty-init-nonpersistent-buffers': ('empty_init_nonpersistent_buffers', ('accelerate.big_modeling', 'torch.nn.modules.module', 'accelerate.utils.modeling')),
    'fsdp-rank-placeholders': ('fsdp_rank_placeholders', ('transformers.modeling_utils', 'accelerate.accelerator', 'accelerate.utils.fsdp_utils')),
    'gemma4-offloaded-embeddings': ('gemma4_offloaded_embeddings', ('transformers.models.gemma4.modeling_gemma4',)),
    'gguf-lazy-eager-mix': ('gguf_lazy_eager_mix', ('gguf.lazy',)),
    'moshi-generate-cpu-disk-map': ('moshi_generate_cpu_disk_map', ('transformers.models.moshi.modeling_moshi',)),
    'offloaded-dtype-conversion': ('offloaded_dtype_conversion', ('transformers.integrations.accelerate',)),
    'offloaded-model-device': ('offloaded_model_device', ('transformers.modeling_utils',)),
    'offloaded-model-device-v4': ('offloaded_model_device_v4', ('transformers.modeling_utils',)),
    'offloaded-move-guard': ('offloaded_move_guard', ('torch.nn.modules.module', 'accelerate.hooks')),
    'offloaded-outside-reads': ('offloaded_outside_reads', ('accelerate.hooks',)),
    'offloaded-placeholder-writes': ('offloaded_placeholder_writes', ('accelerate.hooks',)),
    'offloaded-resize-token-embeddings': ('offloaded_resize_token_embeddings', ('transformers.modeling_utils',)),
    'offloaded-training-refusal': ('offloaded_training_refusal', ('accelerate.hooks', 'torch.optim.optimizer')),
    'peft-offload-redispatch': ('peft_offload_redispatch', ('peft.peft_model', 'peft.mixed_model', 'peft.tuners.tuners_utils', 'peft.utils.save_and_load')),
    'peft-prefix-cache-cpu-map': ('peft_prefix_cache_cpu_map', ('peft.utils.integrations',)),
    'peft-tp-shard-import': ('peft_tp_shard_import', ('peft.utils.save_and_load',)),
    'tied-device-map-accelerate': ('tied_device_map_accelerate', ('accelerate.utils.modeling',)),
    'tied-device-map-disk-index': ('tied_device_map_disk_index', ('transformers.integrations.accelerate',)),
    'tied-device-map-meta-pointer': ('tied_device_map_meta_pointer', ('accelerate.hooks',)),
    'tied-device-map-transformers': ('tied_device_map_transformers', ('transformers.integrations.accelerate',)),
    'tied-device-map-transformers-v4': ('tied_device_map_transformers_v4', ('transformers.modeling_utils',)),
    'transformers-fsdp2-keep-full-weight-reshard': ('transformers_fsdp2_keep_full_weight_reshard', ('transformers.distributed.fsdp',)),
    'transformers-load-adapter-offload': ('transformers_load_adapter_offload', ('transformers.integrations.peft',)),
    'transformers-mismatched-disk-weights': ('transformers_mismatched_disk_weights', ('transformers.core_model_loading',)),
    'transformers-pipeline-offloaded-device': ('transformers_pipeline_offloaded_device', ('transformers.pipelines.base',)),
    'transformers-quantized-disk-weights': ('transformers_quantized_disk_weights', ('transformers.quantizers.quantizer_bnb_4bit', 'transformers.integrations.bitsandbytes', 'transformers.core_model_loading')),
}
