"""`bucketserve cache list|clear`: the models converted from GGUF files
(engine/weights/convert_cache.py), each with the files it came from and its size on disk, and
their removal."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.config import default_cache_dir
from engine.weights import convert_cache

EXIT_USAGE = 2


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one `error:` line, as the launcher's
        self.exit(EXIT_USAGE, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="bucketserve cache",
        description="The models converted from GGUF files, cached "
        "under $BUCKETSERVE_CACHE (default ~/.cache/bucketserve), one copy per file content.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    listing = commands.add_parser("list", help="each cached model: its name, size and source files")
    clearing = commands.add_parser("clear", help="remove every cached model, or the one named")
    clearing.add_argument(
        "entry", nargs="?", help="a name from `cache list`, or the GGUF file it came from"
    )
    for command in (listing, clearing):
        command.add_argument(
            "--cache-dir",
            type=Path,
            help="the cache directory (default: $BUCKETSERVE_CACHE or ~/.cache/bucketserve)",
        )
    return parser


def megabytes(size: int) -> str:
    return f"{size / 1e6:.0f} MB"


def describe(entry: convert_cache.CacheEntry) -> str:
    if not (entry.path / "config.json").is_file():
        origin = "an unfinished conversion"
    else:
        origin = ", ".join(entry.sources) or "source not recorded"
    return f"{entry.name}  {megabytes(entry.size)}  {origin}"


def cmd_list(cache_dir: Path) -> int:
    entries = convert_cache.list_entries(cache_dir)
    if not entries:
        print(f"no cached models in {convert_cache.models_dir(cache_dir)}")
        return 0
    for entry in entries:
        print(describe(entry))
    print(
        f"{len(entries)} cached, {megabytes(sum(e.size for e in entries))} "
        f"in {convert_cache.models_dir(cache_dir)}"
    )
    return 0


def cmd_clear(cache_dir: Path, which: str | None) -> int:
    entries = convert_cache.list_entries(cache_dir)
    chosen = entries if which is None else convert_cache.matching(entries, which)
    if which is not None and not chosen:
        print(f"error: no cached model {which!r} (see `bucketserve cache list`)", file=sys.stderr)
        return EXIT_USAGE
    for entry in chosen:
        convert_cache.remove(entry)
        print(f"removed {entry.name} ({megabytes(entry.size)})")
    if not chosen:
        print(f"no cached models in {convert_cache.models_dir(cache_dir)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cache_dir = args.cache_dir or default_cache_dir()
    try:
        return cmd_list(cache_dir) if args.command == "list" else cmd_clear(cache_dir, args.entry)
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
