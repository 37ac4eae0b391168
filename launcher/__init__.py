"""The launcher and the `bucketserve` command, the top layer: starts one `engine serve` process per
tensor-parallel rank, waits until every one answers Health, supervises them (stop on a signal, stop
or restart on a failure), and starts the router. The offline commands that drive the router's
scheduler over an in-process shard (`bucketserve generate|bench`) live here too, and the
single-process server (`--single-process`: the router with its one shard in place).

`python -m launcher --help` lists the flags; docs/architecture.md#components places it.
"""
