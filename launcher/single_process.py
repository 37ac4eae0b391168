"""`python -m launcher.single_process [router flags] -- [engine serve flags]`: the HTTP router and
one shard in a single process, the shard called in place (router/client.py InProcessClient)
rather than over gRPC. The launcher starts it for `--single-process`.

Why: on a CPU, the router's process and the shard's compete for the same cores. Every step the
router's gRPC call, its answer's parsing and the process switch take a core from one of the
shard's OpenMP threads, and each of the step's parallel regions waits for it. One process saves
that hop; a lone bf16 request on a 2-core VM decoded 1.1-1.3 ms a token faster (docs/benchmarks.md).

Every torch call of this process runs on the shard's worker thread: the model loads on a thread
that ends with it, warmup and steps run on the worker, and the router's grammar check compiles
there too. A second thread that ran a torch parallel region would keep its own OpenMP pool, and
with more OpenMP threads than cores the worker's pool sleeps between regions instead of spinning
(engine/cli/main.py on_a_passing_thread).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from engine.cli.flags import add_knob_flags
from engine.cli.flags import config_from_args as knobs_from_args
from engine.cli.logs import configure_logging
from engine.cli.main import add_engine_args, engine_config, on_a_passing_thread
from engine.config import EngineConfig
from engine.errors import BucketserveError
from router.app import load_tokenizer, run_server, serve_over
from router.client import InProcessClient
from router.config import RouterConfig
from router.http.access import log_request_ids
from router.http.grammar_check import GrammarCheck

# The router's knobs that name or wait for gRPC shards: there are none here.
GRPC_ONLY = ("master_url", "wait_for_shards")


def parse(argv: list[str]) -> tuple[RouterConfig, EngineConfig, bool]:
    """The router's flags before `--`, the engine's after it; and whether to log progress."""
    if "--" not in argv:
        raise BucketserveError(
            "usage: python -m launcher.single_process [router flags] -- [engine flags]"
        )
    cut = argv.index("--")
    router_parser = argparse.ArgumentParser(prog="python -m launcher.single_process")
    add_knob_flags(router_parser, RouterConfig, exclude=GRPC_ONLY)
    engine_parser = argparse.ArgumentParser(prog="python -m launcher.single_process ... --")
    add_engine_args(engine_parser)  # --otlp-endpoint too: the router traces, the shard ignores it
    engine_args = engine_parser.parse_args(argv[cut + 1 :])
    router = knobs_from_args(RouterConfig, router_parser.parse_args(argv[:cut]))
    return router, engine_config(engine_args), engine_args.verbose


def load_shard(config: EngineConfig, verbose: bool):
    """The shard, loaded on a passing thread, after the checks `engine serve` runs at start."""
    from engine.serving.shard import Shard
    from engine.warmup.run import preflight

    shard = on_a_passing_thread(lambda: Shard(config, show_progress=verbose))
    preflight(config, shard.fingerprint())  # a bad profile or trace fails now, not at warmup
    return shard


async def serve(router: RouterConfig, engine: EngineConfig, verbose: bool) -> None:
    loop = asyncio.get_running_loop()
    shard = await loop.run_in_executor(None, load_shard, engine, verbose)
    # After the model, not beside it: two threads importing transformers at once can fail
    # ("cannot import name 'AutoTokenizer'"), and the shard's load has imported it by now.
    tokenizer = loop.run_in_executor(None, load_tokenizer, router)
    client = InProcessClient(shard, max_batch_size=engine.max_batch_size)
    try:
        grammar_check = GrammarCheck(await tokenizer, on_shard_thread=client.on_shard_thread)
        await loop.run_in_executor(None, client.on_shard_thread, grammar_check.prepare)
        await serve_over(router, client, tokenizer, grammar_check=grammar_check)
    finally:
        # a progressive warmup's thread must end before the interpreter does (engine serve's too)
        await loop.run_in_executor(None, shard.close)


def main(argv: list[str] | None = None) -> int:
    log_request_ids(configure_logging(logging.INFO))
    try:
        router, engine, verbose = parse(sys.argv[1:] if argv is None else argv)
    except BucketserveError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return run_server(serve(router, engine, verbose))


if __name__ == "__main__":
    sys.exit(main())
