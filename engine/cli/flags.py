"""Command-line flags built from knob dataclasses (engine/config.py `knob`), and back.

Every flag of `engine serve`, `python -m router` and the launcher that sets a configuration field
is made here from that field: its spellings, default, help and choices live in the field only.
The launcher passes its configuration on with `changed_flags`: each field that differs from its
class default becomes that field's flag, so a new field reaches the shards and the router without
code of its own. Standard library only (the launcher imports it before any shard starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ON_OFF = ("on", "off")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One knob, as a command line sees it."""

    dest: str  # the field's name: the argparse destination
    flags: tuple[str, ...]  # spellings, the canonical one first
    help: str
    default: Any  # the field's default (a value, not its text)
    kind: type  # the field's type, None removed
    meta: dict

    @property
    def flag(self) -> str:
        return self.flags[0]

    def choices(self) -> tuple | None:
        if self.kind is bool and not self.meta["switch"]:
            return ON_OFF
        choices = self.meta["choices"]
        return tuple(choices()) if callable(choices) else choices

    def parse(self):
        """What argparse calls on the flag's text."""
        if self.meta["parse"] is not None:
            return self.meta["parse"]
        return self.kind if self.kind in (int, float, Path) else str

    def value(self, parsed: Any) -> Any:
        """The field's value from what argparse stored."""
        if self.kind is bool and not self.meta["switch"]:
            return parsed == "on" if isinstance(parsed, str) else parsed
        if self.meta["repeat"]:
            items = [] if parsed is None else parsed
            return tuple(part.strip() for item in items for part in item.split(",") if part.strip())
        return parsed

    def argv(self, value: Any) -> list[str]:
        """The command line that sets the field to `value`."""
        if self.meta["switch"]:
            return [self.flag] if value else []
        if self.kind is bool:
            return [self.flag, "on" if value else "off"]
        if self.meta["repeat"]:
            return [text for item in value for text in (self.flag, str(item))]
        if value is None:
            raise ValueError(f"{self.flag}: None cannot be written on a command line")
        text = self.meta["text"] or str
        return [self.flag, text(value)]

    def same_as(self, other: Flag) -> bool:
        keys = ("help", "choices", "env", "switch", "repeat", "secret", "required")
        return (
            self.flags == other.flags
            and self.default == other.default
            and all(self.meta[k] == other.meta[k] for k in keys)
        )


def _bare_type(hint) -> type:
    """`int | None` -> int; `tuple[...]` -> tuple."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else str
    return typing.get_origin(hint) or hint


def knob_flags(cls, defaults: Any = None) -> Iterator[tuple[tuple[str, ...], Flag]]:
    """(path of field names, Flag) for every knob of `cls`, nested dataclasses flattened. The
    defaults come from `defaults` (an instance) where given, else from the fields."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = getattr(defaults, f.name) if defaults is not None else None
        if "nested" in f.metadata:
            for path, flag in knob_flags(f.metadata["nested"], inner):
                yield (f.name, *path), flag
            continue
        if "knob" not in f.metadata:
            continue
        meta = f.metadata["knob"]
        default = inner if defaults is not None else f.default
        flags = meta["flags"] or ("--" + f.name.replace("_", "-"),)
        yield (f.name,), Flag(f.name, flags, meta["help"], default, _bare_type(hints[f.name]), meta)


def unique_flags(cls, defaults: Any = None, only=None, exclude=()) -> dict[str, Flag]:
    """dest -> Flag; a knob that two nested dataclasses share (the same field) appears once. Two
    different knobs under one name are a mistake, refused here. The defaults are those of a
    default instance (where a nested field overrides some), unless `defaults` is given."""
    defaults = cls() if defaults is None else defaults
    out: dict[str, Flag] = {}
    for _, flag in knob_flags(cls, defaults):
        if flag.dest in exclude or (only is not None and flag.dest not in only):
            continue
        if flag.dest in out and not out[flag.dest].same_as(flag):
            raise ValueError(f"two knobs named {flag.dest!r} disagree (flag, default or help)")
        out.setdefault(flag.dest, flag)
    return out


def add_knob_flags(
    parser: argparse.ArgumentParser, cls, defaults: Any = None, only=None, exclude=()
) -> None:
    """One flag per knob of `cls` (or of those named in `only`)."""
    for flag in unique_flags(cls, defaults, only, exclude).values():
        add_flag(parser, flag)


def env_default(flag: Flag) -> Any:
    """The default: the knob's environment variable (TGI's) when it is set, else the field's."""
    text = os.environ.get(flag.meta["env"]) if flag.meta["env"] else None
    if text:
        return text  # argparse parses a text default as it parses the flag's argument
    if flag.kind is bool and not flag.meta["switch"]:
        return "on" if flag.default else "off"
    return None if flag.meta["repeat"] else flag.default


def add_flag(parser: argparse.ArgumentParser, flag: Flag) -> None:
    options: dict[str, Any] = {"dest": flag.dest, "help": flag.help}
    if flag.meta["switch"]:
        options.update(action="store_true", default=bool(flag.default))
    else:
        options.update(type=flag.parse(), default=env_default(flag))
        if flag.meta["repeat"]:
            options["action"] = "append"
        if flag.choices() is not None:
            options["choices"] = flag.choices()
        if flag.meta["metavar"]:
            options["metavar"] = flag.meta["metavar"]
        if flag.meta["required"]:
            options.update(required=True, default=None)
    parser.add_argument(*flag.flags, **options)


def config_from_args(cls, args: argparse.Namespace, defaults: Any = None):
    """An instance of `cls` from parsed flags; a knob without a flag in `args` keeps its default
    (from `defaults`, an instance, where given)."""
    defaults = cls() if defaults is None else defaults
    own = {path[0]: flag for path, flag in knob_flags(cls) if len(path) == 1}
    values = {}
    for f in dataclasses.fields(cls):
        inner = getattr(defaults, f.name)
        if "nested" in f.metadata:
            values[f.name] = config_from_args(f.metadata["nested"], args, inner)
        elif f.name in own and hasattr(args, f.name):
            values[f.name] = own[f.name].value(getattr(args, f.name))
        else:
            values[f.name] = inner
    return cls(**values)


def changed_flags(config: Any, exclude=()) -> list[str]:
    """The command line that gives a parser of `type(config)`'s knobs this configuration: the
    flag of every field that differs from its class default (nested dataclasses included, each
    shared knob once). Secret knobs are left out: they travel in their environment variable."""
    argv: list[str] = []
    seen: set[str] = set()
    for path, flag in knob_flags(type(config)):
        value = config
        for name in path:
            value = getattr(value, name)
        if flag.dest in seen or flag.dest in exclude or flag.meta["secret"]:
            continue
        seen.add(flag.dest)
        if value != flag.default:
            argv += flag.argv(value)
    return argv


def secret_environment(config: Any) -> dict[str, str]:
    """The secret knobs that are set, as their environment variables."""
    out = {}
    for path, flag in knob_flags(type(config)):
        value = config
        for name in path:
            value = getattr(value, name)
        if flag.meta["secret"] and value:
            out[flag.meta["env"]] = str(value)
    return out


def knob_environment_names(cls) -> set[str]:
    """The environment variables that knobs of `cls` read: a child that gets its flags from a
    launcher must not also inherit them (they would pose as defaults the launcher did not see)."""
    return {flag.meta["env"] for _, flag in knob_flags(cls) if flag.meta["env"]}
