"""Speculative decoding on Cloud AI: host proposers (n-gram, suffix) and a draft model, verified on the host."""
