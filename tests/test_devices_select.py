"""--device auto and explicit devices: which adapter starts, and the one line when one cannot."""

import re

import pytest

from engine.devices import choose_device, get_adapter
from engine.devices.probe import Probe
from launcher.cli import bucketserve


def present(*devices, count=2):
    return lambda asked: [
        Probe(d, d in devices, "" if d in devices else "absent", count) for d in asked
    ]


@pytest.mark.parametrize(
    "devices, chosen",
    [
        ((), "cpu"),
        (("xpu",), "xpu"),
        (("cuda", "xpu"), "cuda"),
        (("hpu", "cuda", "xpu"), "hpu"),
        (("hpu",), "hpu"),
    ],
)
def test_auto_prefers_hpu_then_cuda_then_xpu_then_cpu(devices, chosen):
    assert choose_device("auto", probe=present(*devices)) == chosen


def test_auto_needs_enough_devices_for_the_shards_and_a_named_device_is_kept():
    with pytest.raises(Exception, match="--num-shard 4 needs 4 cuda devices, 2 visible"):
        choose_device("auto", 4, probe=present("cuda"))
    assert choose_device("xpu", probe=present()) == "xpu"  # its adapter checks it at start


def test_auto_here_is_cpu():
    adapter = get_adapter("auto")
    assert adapter.name == "cpu" and adapter.device_type == "cpu"


@pytest.mark.parametrize(
    "device, reason",
    [
        ("hpu", r"habana_frameworks is not installed \(it ships in Habana's PyTorch images\)"),
        ("cuda", r"this torch \(.+\) is built without CUDA or ROCm"),
        ("xpu", r"this torch \(.+\) is built without XPU support"),
    ],
)
def test_the_engine_refuses_a_missing_device_in_one_line(capsys, device, reason):
    # (the launcher's same refusal is tested in test_launcher.py)
    code = bucketserve(["generate", "--device", device, "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert code != 0 and re.fullmatch(
        f"error: --device {device} is not usable here: {reason}\n", err
    ), err


def test_info_reports_the_device_auto_chose(tiny_model_dirs):
    from engine.serving.shard import Shard
    from tests.conftest import tiny_config

    shard = Shard(tiny_config(tiny_model_dirs["llama"], device="auto"), show_progress=False)
    assert shard.info().device_type == "cpu" and shard.adapter.graph_mode == "eager"
