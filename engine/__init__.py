"""The engine: one shard, the bottom layer; it imports neither `router` nor `launcher`. Its folders
are described in docs/architecture.md#layers-and-layout."""
