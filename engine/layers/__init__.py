"""Model building blocks: (parallel) linear layers, embeddings, norms, rotary embeddings, LoRA.
Imports engine.distributed and engine.errors only; the models are built on these, never the
reverse."""
