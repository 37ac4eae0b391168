"""The XPU adapter on a faked torch.xpu: native by default, IPEX and oneCCL only when installed.

The fake is torch.xpu as a torch 2.5 build has it (pytorch/pytorch v2.5.1, torch/xpu/memory.py):
memory_reserved and get_device_properties, no mem_get_info (added in 2.6, and its free figure
ignores the process's own allocations, pytorch#161381)."""

import sys
from types import SimpleNamespace

import pytest
import torch

from engine.devices import get_adapter
from engine.devices.probe import DeviceError
from tests.fakes.modules import fake_module, install

TOTAL, RESERVED = 64 << 30, 10 << 30


@pytest.fixture
def xpus(monkeypatch):
    calls = {"set_device": []}
    for name, value in dict(
        _is_compiled=lambda: True,
        is_available=lambda: True,
        device_count=lambda: 4,
        set_device=calls["set_device"].append,
        synchronize=lambda index=None: None,
        memory_reserved=lambda index=None: RESERVED,
        get_device_properties=lambda index=None: SimpleNamespace(total_memory=TOTAL),
    ).items():
        monkeypatch.setattr(torch.xpu, name, value, raising=False)
    monkeypatch.delattr(torch.xpu, "mem_get_info", raising=False)  # torch 2.5
    monkeypatch.setattr(torch, "__version__", "2.7.1+xpu")
    for name in ("oneccl_bindings_for_pytorch", "intel_extension_for_pytorch"):
        monkeypatch.setitem(sys.modules, name, None)  # absent unless a test installs a fake
    return calls


def test_native_xpu_without_intel_extension(xpus):
    adapter = get_adapter("xpu", rank=5, world_size=6)
    assert adapter.dist_backend == "xccl" and adapter.ipex is None and adapter.graph_mode == "eager"
    assert (
        adapter.index == 1
        and xpus["set_device"] == [1]
        and adapter.torch_device == torch.device("xpu", 1)
    )
    assert adapter.default_dtype == torch.bfloat16


def test_free_memory_is_what_this_process_has_not_reserved(xpus, monkeypatch):
    # Finding 9: no mem_get_info before torch 2.6; where it exists, it ignores our own allocations.
    assert get_adapter("xpu").memory_info() == (TOTAL - RESERVED, TOTAL)
    monkeypatch.setattr(torch.xpu, "mem_get_info", lambda index=None: (TOTAL, TOTAL), raising=False)
    assert get_adapter("xpu").memory_info() == (TOTAL - RESERVED, TOTAL)


def test_several_ranks_need_xccl_from_torch_2_7_or_the_oneccl_bindings(xpus, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.6.0+xpu")
    get_adapter("xpu")  # one rank: no collectives needed
    with pytest.raises(
        DeviceError,
        match=r"torch 2.6.0\+xpu has no xccl \(torch >= 2.7 does\); install "
        r"oneccl_bindings_for_pytorch",
    ):
        get_adapter("xpu", world_size=2)
    install(
        monkeypatch, {"oneccl_bindings_for_pytorch": fake_module("oneccl_bindings_for_pytorch")}
    )
    assert get_adapter("xpu", world_size=2).dist_backend == "ccl"


def test_oneccl_bindings_switch_collectives_to_ccl_and_ipex_is_used_when_present(xpus, monkeypatch):
    ccl, ipex = (
        fake_module("oneccl_bindings_for_pytorch"),
        fake_module("intel_extension_for_pytorch"),
    )
    install(monkeypatch, {"oneccl_bindings_for_pytorch": ccl, "intel_extension_for_pytorch": ipex})
    adapter = get_adapter("xpu")
    assert adapter.dist_backend == "ccl" and adapter.ipex is ipex


def test_no_visible_xpu_is_one_clear_error(xpus, monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    with pytest.raises(
        DeviceError, match=r"^--device xpu is not usable here: no Intel XPU device is visible"
    ):
        get_adapter("xpu")


def test_releasing_memory_hands_the_cached_blocks_back_before_a_new_cache_is_sized(
    xpus, monkeypatch
):
    # torch/xpu/memory.py (v2.5.1): empty_cache() releases the unoccupied cached memory that
    # memory_reserved() counts, and with it what a dropped KV cache left reserved.
    reserved = {"bytes": RESERVED}
    monkeypatch.setattr(torch.xpu, "memory_reserved", lambda index=None: reserved["bytes"])
    monkeypatch.setattr(torch.xpu, "empty_cache", lambda: reserved.update(bytes=1 << 30))
    adapter = get_adapter("xpu")
    model = SimpleNamespace(
        layers=[1, 2], config=None, bind_kv_cache=lambda caches: bound.append(caches)
    )
    bound = []
    adapter.release_memory(model)
    assert bound == [[None, None]] and adapter.memory_info() == (TOTAL - (1 << 30), TOTAL)
