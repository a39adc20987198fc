"""The traced export route: transformers' own model code, with the KV cache written through CtxScatter."""
