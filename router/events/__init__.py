"""What the router tells the outside about its state beyond HTTP: KV-cache events over ZMQ in vLLM's
format (kv_events.py), for the KV-aware routers of a fleet (vllm-router's kv_aware, llm-d,
Dynamo)."""
