"""The router, the middle layer: the wiring that starts it (app.py), the shard client over gRPC or
an in-process shard (client.py), offline generation with the same scheduler (offline.py), and two
wings: sched/ (continuous batching, KV blocks, prefix cache) and http/ (TGI's and OpenAI's APIs).
Imports the engine's shared modules and its wire contract, never the shard's serving code or the
launcher."""
