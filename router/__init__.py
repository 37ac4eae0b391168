"""The router: schedules requests onto generate.v3 shards."""
