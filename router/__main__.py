"""`python -m router --master-shard-uds-path unix://BASE-0 --tokenizer MODEL_DIR --port 8080 ...`"""

import asyncio
import logging
import sys

from engine.cli.logs import configure_logging
from router.app import build_parser, config_from_args, serve
from router.http.access import log_request_ids


def main(argv: list[str] | None = None) -> int:
    log_request_ids(configure_logging(logging.INFO))  # a request's lines name its request id
    config = config_from_args(build_parser().parse_args(argv))
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
