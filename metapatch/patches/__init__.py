"""One module per patch; each defines ``PATCH``, a :class:`metapatch.Patch`. Modules here must
stay import-cheap: anything from torch or the Hugging Face stack is imported inside functions."""
