"""The engine: one shard, the bottom layer. It imports neither `router` nor `launcher`.

Its root holds the modules every part shares (config, batch dataclasses, errors, the KV cache, the
model runner, sampling, grammars, weight loading); each folder below holds one concern.
"""
