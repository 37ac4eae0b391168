"""Choosing tokens from logits: the sampling parameters' checks, the warpers and penalties, the
grammar and min_new_tokens mask, greedy and seeded draws (sampler.py). The shard's steps and the
speculative proposers and their acceptance rule both sample, so it sits below both."""
