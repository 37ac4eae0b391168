"""The router, the middle layer: schedules requests onto generate.v3 shards (scheduler, allocator,
client), validates them, and serves the TGI and OpenAI HTTP APIs (state, tgi_api, openai_api, app);
offline.py drives an in-process shard with the same scheduler. Imports the engine, never the launcher."""
