"""The router's scheduling wing: the continuous-batching loop (scheduler.py), what it admits
(admission.py, batching.py), KV blocks (allocator.py, prefix_cache.py, kv_blocks.py), preemption,
n/best_of groups (fanout.py) and each request's stream (streams.py). Imports no HTTP code."""
