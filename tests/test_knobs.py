"""One declaration per knob: the engine's, the router's and the launcher's command lines are built
from the configuration dataclasses' fields, agree on every knob they share, and a new field reaches
the shards and the router through the launcher with no code of its own."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from engine.cli.flags import (
    add_knob_flags,
    changed_flags,
    config_from_args,
    knob_flags,
    unique_flags,
)
from engine.cli.main import build_parser as engine_parser
from engine.cli.main import engine_config
from engine.config import EngineConfig, SharedKnobs, knob, nested
from launcher.cli import build_parser as launcher_parser
from launcher.config import ROUTER_DEFAULTS, ROUTER_SET_BY_LAUNCHER, LauncherConfig
from router.app import build_parser as router_parser
from router.app import config_from_args as router_config
from router.config import RouterConfig

KNOB_VARIABLES = (
    "MAX_BATCH_SIZE",
    "LORA_ADAPTERS",
    "BUCKETSERVE_API_KEY",
    "BUCKETSERVE_PARENT_PID",
)


@pytest.fixture(autouse=True)
def no_knob_variables(monkeypatch):
    """The parsers' defaults here are the fields' own, not a developer's environment."""
    for name in KNOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> the action of each flag (help and positionals aside)."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def parsers() -> dict[str, dict[str, argparse.Action]]:
    return {
        "engine": options(subcommand(engine_parser(), "serve")),
        "router": options(router_parser()),
        "launcher": options(launcher_parser()),
    }


def described(action: argparse.Action) -> tuple:
    return tuple(action.option_strings), action.default, action.help, action.choices


def expected(flag, default=None) -> tuple:
    """What a parser built from the field shows: its spellings, default (as argparse holds it),
    help and choices."""
    value = flag.default if default is None else default
    if flag.kind is bool and not flag.meta["switch"]:
        value = "on" if value else "off"
    elif flag.meta["repeat"] or flag.meta["required"]:
        value = None
    return flag.flags, value, flag.help, flag.choices()


def test_every_shared_knob_has_one_flag_default_and_help_in_all_three_parsers():
    built = parsers()
    for field in dataclasses.fields(SharedKnobs):
        seen = {name: described(actions[field.name]) for name, actions in built.items()}
        assert len(set(seen.values())) == 1, (field.name, seen)
        flag = unique_flags(SharedKnobs)[field.name]
        assert seen["engine"] == expected(flag), field.name


def test_every_parser_shows_each_field_as_the_field_declares_it():
    """A flag declared by hand (another default, other help) beside or instead of the field's
    fails here."""
    built = parsers()
    for name, cls, actions in (
        ("engine", EngineConfig, built["engine"]),
        ("router", RouterConfig, built["router"]),
    ):
        for dest, flag in unique_flags(cls).items():
            assert described(actions[dest]) == expected(flag), (name, dest)
    launcher = LauncherConfig()
    for dest, flag in unique_flags(LauncherConfig, exclude=ROUTER_SET_BY_LAUNCHER).items():
        assert described(built["launcher"][dest]) == expected(flag), dest
        class_default = unique_flags(RouterConfig).get(dest) or unique_flags(EngineConfig).get(dest)
        if class_default is not None and dest not in ROUTER_DEFAULTS:  # one default per knob
            assert flag.default == class_default.default, dest
    assert (
        launcher.router.port == ROUTER_DEFAULTS["port"] != RouterConfig().port
    )  # TGI's, documented


def test_the_launcher_parser_has_every_shard_and_router_knob_once():
    launcher = parsers()["launcher"]
    engine_dests = set(unique_flags(EngineConfig))
    router_dests = set(unique_flags(RouterConfig)) - set(ROUTER_SET_BY_LAUNCHER)
    assert engine_dests | router_dests <= set(launcher)
    spellings = [s for a in launcher.values() for s in a.option_strings]
    assert len(spellings) == len(set(spellings))


def test_the_old_flag_spellings_still_parse():
    parsed = engine_parser().parse_args(["serve", "--max-prefill-tokens", "99", "--warmup", "none"])
    assert (parsed.max_prefill_tokens, parsed.warmup_mode) == (99, "none")
    parsed = engine_parser().parse_args(["serve", "--max-batch-prefill-tokens", "98"])
    assert parsed.max_prefill_tokens == 98
    routed = router_config(
        router_parser().parse_args(
            ["--master-shard-uds-path", "/tmp/x-0", "--max-batch-prefill-tokens", "97"]
        )
    )
    assert (routed.max_prefill_tokens, routed.master_url) == (97, "unix:///tmp/x-0")


def test_one_default_for_the_batch_size_and_the_device():
    assert EngineConfig().max_batch_size == RouterConfig().max_batch_size == 32
    assert LauncherConfig().engine.max_batch_size == LauncherConfig().router.max_batch_size == 32
    assert (
        EngineConfig().device
        == engine_config(engine_parser().parse_args(["serve"])).device
        == "auto"
    )


# --- every field reaches the shard and the router -------------------------------------------------


def different(flag):
    """A value of the knob's type other than its default."""
    default, kind = flag.default, flag.kind
    if flag.choices():
        if kind is bool:
            return not default
        return next(c for c in flag.choices() if c != default)
    if kind is bool:
        return not default
    if kind is int:
        return (default or 0) + 7
    if kind is float:
        return (default or 0.0) + 0.5
    if kind is Path:
        return Path("/tmp/knob-test")
    if flag.dest == "lora_adapters":
        return (("a", "/adapters/a"), ("b", "b"))
    if flag.dest == "dtype":  # checked by its own parser (engine.config.dtype_name)
        return "float32"
    if flag.meta["repeat"]:
        return ("https://a.example", "https://b.example")
    return f"value-of-{flag.dest}"


def every_field_changed(cls, skip=()):
    values = {}
    for f in dataclasses.fields(cls):
        if "nested" in f.metadata:
            values[f.name] = every_field_changed(f.metadata["nested"], skip)
        elif f.name not in skip:
            values[f.name] = different(next(fl for p, fl in knob_flags(cls) if p == (f.name,)))
    return cls(**values)


def test_every_engine_field_round_trips_through_the_launcher_to_the_shard():
    engine = every_field_changed(EngineConfig)
    assert all(getattr(engine, f.name) != f.default for f in dataclasses.fields(EngineConfig))
    launched = LauncherConfig(engine=engine, uds_path="/tmp/s")
    assert engine_config(engine_parser().parse_args(["serve", *launched.shard_args()])) == engine


def test_every_router_field_round_trips_through_the_launcher_to_the_router():
    engine = every_field_changed(EngineConfig)
    router = every_field_changed(RouterConfig, skip=ROUTER_SET_BY_LAUNCHER)
    launched = LauncherConfig(engine=engine, router=router, uds_path="/tmp/s", startup_timeout=12.5)
    expected_router = launched.router_config()
    assert expected_router.max_batch_size == engine.max_batch_size  # shared: the shards' value
    assert (
        expected_router.access.api_key
        and expected_router.access.api_key not in launched.router_args()
    )
    environment = launched.router_environment({"MAX_BATCH_SIZE": "3", "PATH": "/bin"})
    assert environment["BUCKETSERVE_API_KEY"] == expected_router.access.api_key
    assert "MAX_BATCH_SIZE" not in environment  # no variable beside a flag
    parsed = router_parser().parse_args(launched.router_args())
    secret = dataclasses.replace(expected_router.access, api_key=None)
    assert router_config(parsed) == dataclasses.replace(expected_router, access=secret)


def test_the_launcher_parser_fills_both_configs_from_one_shared_flag():
    config = config_from_args(
        LauncherConfig,
        launcher_parser().parse_args(
            ["--max-batch-size", "5", "--port", "3100", "--dtype", "float32"]
        ),
    )
    assert config.engine.max_batch_size == config.router.max_batch_size == 5
    assert (config.router.port, config.engine.dtype) == (3100, "float32")


def test_no_environment_variable_beside_the_batch_size_flag(monkeypatch):
    from engine.devices.probe import cpu_plan
    from launcher.logs import Console
    from launcher.supervisor import ShardGroup

    monkeypatch.setenv("MAX_BATCH_SIZE", "6")  # the user's: the launcher reads it as the default
    monkeypatch.setenv("LORA_ADAPTERS", "x=/x")
    config = config_from_args(
        LauncherConfig, launcher_parser().parse_args(["--uds-path", "/tmp/s"])
    )
    group = ShardGroup(config, cpu_plan(1, {}), Console())
    group.master_port = 29999
    environment = group._env(0)
    assert "MAX_BATCH_SIZE" not in environment and "LORA_ADAPTERS" not in environment
    args = config.shard_args()
    assert args[args.index("--max-batch-size") + 1] == "6" and "x=/x" in args


def test_the_engine_honours_tgis_batch_size_variable_when_no_flag_is_given(monkeypatch):
    monkeypatch.setenv("MAX_BATCH_SIZE", "6")
    assert engine_config(engine_parser().parse_args(["serve"])).max_batch_size == 6
    assert (
        engine_config(engine_parser().parse_args(["serve", "--max-batch-size", "3"])).max_batch_size
        == 3
    )


# --- a new knob is one field ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class NewSharedKnob:
    spill_watermark: int = knob(5, "a knob that the shards and the router both read")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WiderEngine(EngineConfig, NewSharedKnob):
    shard_only: str | None = knob(None, "a knob of the shards alone", choices=("x", "y"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WiderRouter(RouterConfig, NewSharedKnob):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class WiderLauncher(LauncherConfig):
    engine: WiderEngine = nested(WiderEngine)
    router: WiderRouter = nested(WiderRouter, **ROUTER_DEFAULTS)


def parser_of(cls, exclude=()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_knob_flags(parser, cls, exclude=exclude)
    return parser


def test_adding_one_field_gives_a_flag_everywhere_and_it_reaches_shard_and_router():
    launcher = parser_of(WiderLauncher, exclude=ROUTER_SET_BY_LAUNCHER)
    for parser in (parser_of(WiderEngine), parser_of(WiderRouter), launcher):
        action = options(parser)["spill_watermark"]
        assert (action.option_strings, action.default) == (["--spill-watermark"], 5)
    assert "shard_only" in options(launcher) and "shard_only" not in options(parser_of(WiderRouter))
    config = config_from_args(
        WiderLauncher,
        launcher.parse_args(
            ["--spill-watermark", "9", "--shard-only", "y", "--uds-path", "/tmp/s"]
        ),
    )
    shard_argv = ["--verbose", "--uds-path", "/tmp/s", *changed_flags(config.engine)]
    assert config.shard_args() == shard_argv
    shard = config_from_args(WiderEngine, parser_of(WiderEngine).parse_args(shard_argv[3:]))
    assert (shard.spill_watermark, shard.shard_only) == (9, "y")
    router = config_from_args(WiderRouter, parser_of(WiderRouter).parse_args(config.router_args()))
    assert router.spill_watermark == 9


def test_two_different_knobs_under_one_name_are_refused():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Other:
        max_batch_size: int = knob(8, "another default for the same name")

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Both:
        engine: EngineConfig = nested(EngineConfig)
        other: Other = nested(Other)

    with pytest.raises(ValueError, match="two knobs named 'max_batch_size' disagree"):
        parser_of(Both)


def test_wide_configurations_are_built_by_keyword():
    from engine.serving.steps import StepContext

    for cls in (EngineConfig, RouterConfig, LauncherConfig, StepContext):
        with pytest.raises(TypeError):
            cls(*([None] * 3))
