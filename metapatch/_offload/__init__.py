"""The mechanisms patches share over torch, accelerate, peft and bitsandbytes objects: the one reader of
accelerate's hook state, the offload store, adapter offload, reads outside a module's hook, ties, buffer
rebuilds, rank sync. Imports the framework (:mod:`metapatch._framework`), never a patch; torch and the
Hugging Face packages only inside functions."""
