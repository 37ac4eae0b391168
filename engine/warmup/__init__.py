"""Warmup: size the KV cache from free memory (memory.py), warm buckets one by one (warm.py) fully
or progressively in the background (progressive.py, run.py), and warmup profiles with their plots
(profile.py, plots.py). Imports buckets/, the runner and the KV cache; never serving/ or cli/."""
