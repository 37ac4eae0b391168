"""`python -m router --master-shard-uds-path unix://BASE-0 --tokenizer MODEL_DIR --port 8080 ...`"""

import asyncio
import logging
import sys

from engine.cli.logs import configure_logging
from engine.errors import BucketserveError
from router.app import build_parser, config_from_args, serve
from router.client import ShardError
from router.http.access import log_request_ids


def main(argv: list[str] | None = None) -> int:
    log_request_ids(configure_logging(logging.INFO))  # a request's lines name its request id
    config = config_from_args(build_parser().parse_args(argv))
    if config.drain_timeout < 0:
        print(
            f"error: --drain-timeout must be at least 0, not {config.drain_timeout:g}",
            file=sys.stderr,
        )
        return 2
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    except (BucketserveError, ShardError, OSError) as err:
        # one line, as the engine's and the launcher's commands print (a corrupt model file, the
        # shards unreachable): the launcher shows it beside the shard's own
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
