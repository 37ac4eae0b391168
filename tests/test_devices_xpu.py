"""The XPU adapter on a faked torch.xpu: native by default, IPEX and oneCCL only when installed."""
import sys

import pytest
import torch

from engine.devices import get_adapter
from engine.devices.probe import DeviceError
from tests.fakes.modules import fake_module, install


@pytest.fixture
def xpus(monkeypatch):
    calls = {"set_device": []}
    for name, value in dict(_is_compiled=lambda: True, is_available=lambda: True, device_count=lambda: 4,
                            set_device=calls["set_device"].append, synchronize=lambda index=None: None,
                            mem_get_info=lambda index=None: (10 << 30, 64 << 30)).items():
        monkeypatch.setattr(torch.xpu, name, value)
    for name in ("oneccl_bindings_for_pytorch", "intel_extension_for_pytorch"):
        monkeypatch.setitem(sys.modules, name, None)  # absent unless a test installs a fake
    return calls


def test_native_xpu_without_intel_extension(xpus):
    adapter = get_adapter("xpu", rank=5, world_size=6)
    assert adapter.dist_backend == "xccl" and adapter.ipex is None and adapter.graph_mode == "eager"
    assert adapter.index == 1 and xpus["set_device"] == [1] and adapter.torch_device == torch.device("xpu", 1)
    assert adapter.memory_info() == (10 << 30, 64 << 30) and adapter.default_dtype == torch.bfloat16


def test_oneccl_bindings_switch_collectives_to_ccl_and_ipex_is_used_when_present(xpus, monkeypatch):
    ccl, ipex = fake_module("oneccl_bindings_for_pytorch"), fake_module("intel_extension_for_pytorch")
    install(monkeypatch, {"oneccl_bindings_for_pytorch": ccl, "intel_extension_for_pytorch": ipex})
    adapter = get_adapter("xpu")
    assert adapter.dist_backend == "ccl" and adapter.ipex is ipex


def test_no_visible_xpu_is_one_clear_error(xpus, monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"^--device xpu is not usable here: no Intel XPU device is visible"):
        get_adapter("xpu")
