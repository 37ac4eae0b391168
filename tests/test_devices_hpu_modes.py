"""Which graph mode a Gaudi shard runs, and the bridge mode the launcher starts it in (review
finding M13): the mode asked for, else the installed Habana release's default (compile from 1.23,
lazy mode with HPU graphs on 1.21 and 1.22), and no lazy mode where torch is upstream's. Against
the strict fake bridge (tests/fakes/habana.py), whose package metadata says the release."""

import os
import sys

import pytest

from engine.devices import get_adapter
from engine.devices.hpu.adapter import HPUAdapter
from engine.devices.probe import DeviceError, Probe, resolve_device, safe_probe
from launcher import cli
from launcher.logs import Console
from tests.fakes.habana import FakeHabana
from tests.test_devices_hpu import HPU_VARS

LIMITS = ["--max-input-tokens", "64", "--max-total-tokens", "128"]
GAUDI = lambda asked: [Probe("hpu", True, count=8)]  # noqa: E731


@pytest.fixture
def environ(monkeypatch):
    """The launcher's environment, without any Habana variable of this machine's."""
    clean = {k: v for k, v in os.environ.items() if k not in HPU_VARS}
    monkeypatch.setattr(os, "environ", clean)
    for name in ("vllm_hpu_extension", "vllm_gaudi"):
        monkeypatch.setitem(sys.modules, name, None)  # absent: pure torch decode attention
    monkeypatch.setattr(HPUAdapter, "torch_device_type", "cpu")  # the fake runs it on CPU
    # The probe that runs in a child process runs here, against the fake bridge.
    monkeypatch.setattr(
        "engine.devices.probe.probe_in_child", lambda devices: [safe_probe(d) for d in devices]
    )
    return clean


def launch(model_dir, *flags):
    args = cli.build_parser().parse_args(["--model-id", str(model_dir), *LIMITS, *flags])
    return cli.resolve(cli.config_from_args(args), Console())


def start_shard(monkeypatch, plan, graph_mode, **fake) -> HPUAdapter:
    """A shard as the launcher starts it: its environment, then the bridge's import reads it."""
    os.environ.update(plan.env(0))
    FakeHabana(**fake).install(monkeypatch)
    return get_adapter("hpu", graph_mode=graph_mode)


def test_compile_mode_shards_start_with_the_bridge_in_eager_mode(
    monkeypatch, environ, tiny_model_dirs
):
    FakeHabana(release="1.22.0").install(monkeypatch)  # where lazy mode is the default
    config, plan = launch(tiny_model_dirs["llama"], "--device", "hpu", "--graph-mode", "compile")
    assert plan.env(0)["PT_HPU_LAZY_MODE"] == "0" and config.engine.graph_mode == "compile"
    adapter = start_shard(monkeypatch, plan, config.engine.graph_mode, release="1.22.0")
    assert adapter.graph_mode == "compile" and not adapter.lazy and adapter.step_marker is None


def test_lazy_collectives_follow_the_world_size_not_the_shards_of_one_node(monkeypatch, environ):
    FakeHabana(release="1.22.0").install_metadata(monkeypatch)
    # one Gaudi on each of two nodes: the collectives run inside lazy graphs all the same
    plan = resolve_device("hpu", 1, {}, lambda: ["hpu"], probe=GAUDI, world_size=2)
    assert plan.env(0)["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "1"


@pytest.mark.parametrize(
    "release, fork, expected",
    [
        ("1.21.3", True, "graphs"),
        ("1.22.0", True, "graphs"),
        ("1.23.0", True, "compile"),
        ("1.24.1", True, "compile"),
        ("1.22.0", False, "compile"),  # an upstream-PyTorch image: there is no lazy mode
    ],
)
def test_the_default_graph_mode_is_the_installed_releases(
    monkeypatch, environ, release, fork, expected
):
    FakeHabana(release=release, fork=fork).install_metadata(monkeypatch)
    plan = resolve_device("hpu", 1, {}, lambda: ["hpu"], probe=GAUDI)
    assert plan.graph_mode == expected
    assert plan.env(0)["PT_HPU_LAZY_MODE"] == ("0" if expected == "compile" else "1")
    # a shard not told the mode picks the same one as the launcher, so it starts in its environment
    adapter = start_shard(monkeypatch, plan, None, release=release, fork=fork)
    assert adapter.graph_mode == expected


def test_a_lazy_mode_the_user_set_picks_the_default(monkeypatch, environ):
    FakeHabana(release="1.24.1").install_metadata(monkeypatch)
    plan = resolve_device("hpu", 1, {"PT_HPU_LAZY_MODE": "1"}, lambda: ["hpu"], probe=GAUDI)
    assert plan.graph_mode == "graphs" and "PT_HPU_LAZY_MODE" not in plan.env(0)


def test_lazy_mode_on_an_image_without_it_is_refused_in_one_line(
    monkeypatch, environ, tiny_model_dirs, capsys
):
    FakeHabana(release="1.24.1", fork=False).install(monkeypatch)
    monkeypatch.setattr(cli, "supervise", lambda *args: pytest.fail("a shard was started"))
    flags = ["--device", "hpu", "--graph-mode", "lazy"]
    code = cli.main(["--model-id", str(tiny_model_dirs["llama"]), *LIMITS, *flags])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --graph-mode lazy needs Habana's lazy mode") and err.endswith(
        "use --graph-mode compile\n"
    )
    # and a shard started without the launcher says the same before the bridge is imported
    with pytest.raises(DeviceError, match=r"--graph-mode graphs .* use --graph-mode compile"):
        get_adapter("hpu", graph_mode="graphs")
