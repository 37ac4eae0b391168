"""`python -m router --master-shard-uds-path unix://BASE-0 --tokenizer MODEL_DIR --port 8080 ...`"""

import logging
import sys

from engine.cli.logs import configure_logging
from router.app import build_parser, config_from_args, run_server, serve
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
    return run_server(serve(config))


if __name__ == "__main__":
    sys.exit(main())
