"""Intel Gaudi (HPU): the adapter (adapter.py), the launch environment (vars.py, env.py),
vllm-hpu-extension's kernels (ops.py) and the attention that calls them (attention.py), and
optimum-habana for the transformers fallback (optimum.py). Habana's libraries are imported
lazily."""
