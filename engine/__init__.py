"""The engine: one shard, the bottom layer. It imports neither `router` nor `launcher`.

Its root holds what every part of the shard shares: configuration (config.py), the protocol's
dataclasses (batch.py), errors, the KV cache, the model runner, grammars and torch.distributed set-up.
Each folder below holds one concern: wire/ (the generate.v3 contract), weights/ (loaders), models/,
layers/, attention/, buckets/, warmup/, devices/, serving/ (the Shard and its gRPC server), cli/.
"""
