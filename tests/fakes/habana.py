"""A fake `habana_frameworks.torch`, as strict as the real bridge where the adapter depends on it.

Mirrors habana_frameworks/torch/hpu/graphs.py of the Habana PyTorch bridge (habana-torch-plugin
1.21/1.22; the wheel's source, read through the search index: it has no public repository to pin a
commit of):
- `wrap_in_hpu_graph(module, asynchronous, disable_tensor_cache, dry_run, max_graphs)` keys graphs by
  the hash of the inputs alone (tensors by shape, Python scalars by value), captures on the first
  call and replays afterwards, returning the very output tensors of the capture every time.
  A replay re-runs the captured ops on the captured tensors (tests/fakes/recording.py): a module
  attribute swapped since the capture (a KV cache) is not seen, as on the device.
  `bypass_hpu_graphs=True` runs the module eagerly; `module.clear_cache()` drops every graph.
- PT_HPU_LAZY_MODE is read once, when the bridge is imported (with `import torch` in current
  releases, through torch's device-backend autoload); unset means eager (the 1.21+ default), and
  `htorch.utils.internal.is_lazy()` answers what was read then. On an upstream-PyTorch image
  (`fork=False`) there is no lazy mode: the bridge runs eagerly whatever the variable says.
- The installed packages' metadata, as pip has it: habana-torch-plugin at the release
  ("1.22.0.740"), and torch as Habana's fork names itself ("2.6.0+hpu_1.21.2-76.gitabf798b") or,
  on an upstream image, as torch's own build.
- `habana_frameworks.torch.distributed.hccl` registers the "hccl" backend when it is imported.
- `habana_frameworks.torch.utils.experimental._get_device_type()` against `synDeviceType`, and the
  FP8 ops `torch.ops.hpu.cast_to_fp8_v2(input, scale, stochastic_rounding, is_amax, dtype)` ->
  (fp8, amax) and `torch.ops.hpu.fp8_gemm_v2(A, trans_A, B, trans_B, D, out_dtype, A_scale_inv,
  B_scale_inv, bias, accumulate)` as vllm-hpu-extension calls them (vllm_hpu_extension/ops.py
  @8211e0ba420e976cca07be323328e41fa8a1a9da, apply_fp8_linear_hpu and dynamic_quant): keyword
  arguments, float8_e4m3fn operands only, scales as inverse (dequantizing) factors. On Gaudi 2 the
  matrix engine's e4m3 spans +-240 (the extension's FP8_MAX there is float8_e4m3fnuz's max): an
  operand past it is refused here, where the device would compute with other numbers.

Where the bridge differs from this fake, the fake is the stricter one.
"""

from __future__ import annotations

import os
from importlib import metadata

import torch

from tests.fakes.modules import fake_module, install, install_on_import
from tests.fakes.recording import RecordedOps, recording


def input_hash(value):
    """As graphs.input_hash: tensors by shape (not by dtype or content), everything else by value."""
    if isinstance(value, dict):
        return input_hash(tuple(value.items()))
    if isinstance(value, (tuple, list)):
        return hash(tuple(input_hash(v) for v in value))
    if isinstance(value, torch.Tensor):
        return hash(("tensor", tuple(value.shape)))
    return hash(value)


def copy_to(dst, src) -> None:
    """As graphs.copy_to: the fresh inputs into the captured ones, structure for structure."""
    assert type(dst) is type(src), (
        f"graph input was {type(dst).__name__} at capture, now {type(src).__name__}"
    )
    if isinstance(dst, dict):
        for (dk, dv), (sk, sv) in zip(dst.items(), src.items()):
            assert dk == sk
            copy_to(dv, sv)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            copy_to(d, s)
    elif isinstance(dst, torch.Tensor):
        if any(stride == 0 and size > 1 for stride, size in zip(dst.stride(), dst.shape)):
            # An expanded input cannot be copied into; with disable_tensor_cache the real wrapper
            # reads the caller's tensor instead, which this fake can stand in for only when equal.
            assert torch.equal(dst, src), (
                "an expanded graph input changed between capture and replay"
            )
        else:
            dst.copy_(src)


class Captured:
    def __init__(self, inputs, outputs, graph: RecordedOps):
        self.inputs, self.outputs, self.graph = inputs, outputs, graph


GAUDI2_FP8_MAX = 240.0
DEVICE_TYPES = {"gaudi2": 4, "gaudi3": 5}  # synDeviceType values, as in synapse's types


class FakeHabana:
    def __init__(
        self,
        devices: int = 8,
        memory: tuple[int, int] = (60 << 30, 96 << 30),
        graph_bytes: int = 0,
        hardware: str = "gaudi2",
        release: str = "1.22.0",
        fork: bool = True,
    ):
        self.devices, self.memory, self.hardware = devices, memory, hardware
        self.release, self.fork = release, fork
        self.fp8_gemms = 0
        self.graph_bytes = graph_bytes  # device memory each captured graph holds (0: free)
        self.lazy: bool | None = None  # PT_HPU_LAZY_MODE as read at import
        self.trace: list = []  # "mark_step" and whatever a test appends, in order
        self.wraps: list = []  # (module, kwargs) of each wrap_in_hpu_graph
        self.caches: list[dict] = []  # each wrapped module's graphs, by input hash
        self.captures: list = []
        self.replays: list = []
        self.bypasses: list = []
        self.hccl_imported = False

    @property
    def graphs(self) -> set:
        return {key for cache in self.caches for key in cache}

    def mark_step(self) -> None:
        self.trace.append("mark_step")

    def wrap_in_hpu_graph(
        self, module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None
    ):
        self.wraps.append((module, dict(disable_tensor_cache=disable_tensor_cache)))
        original, cache = module.forward, {}
        self.caches.append(cache)

        def forward(*args, **kwargs):
            if kwargs.pop("bypass_hpu_graphs", False):
                self.bypasses.append(input_hash((args, kwargs)))
                return original(*args, **kwargs)
            key = input_hash((args, kwargs))
            if key not in cache:
                if max_graphs is not None and len(cache) == max_graphs:
                    return original(*args, **kwargs)
                self._allocate(self.graph_bytes)
                graph = RecordedOps()
                with recording(graph):
                    outputs = original(*args, **kwargs)
                cache[key] = Captured((args, kwargs), outputs, graph)
                self.captures.append(key)
                return outputs
            self.replays.append(key)
            copy_to(cache[key].inputs, (args, kwargs))
            cache[key].graph.replay()
            return cache[key].outputs

        def clear_cache():
            self._release(self.graph_bytes * len(cache))
            cache.clear()

        module.forward, module.clear_cache = forward, clear_cache
        return module

    # --- FP8 ----------------------------------------------------------------------------------

    def _fp8_range(self) -> float:
        return GAUDI2_FP8_MAX if self.hardware == "gaudi2" else 448.0

    def cast_to_fp8_v2(
        self, input, scale=None, stochastic_rounding=False, is_amax=False, dtype=None
    ):
        assert dtype == torch.float8_e4m3fn, f"cast_to_fp8_v2 to {dtype}"
        assert not input.dtype.is_floating_point or input.element_size() >= 2
        scaled = input.float() * (1.0 if scale is None else scale)
        limit = self._fp8_range()
        return scaled.clamp(-limit, limit).to(dtype), scaled.abs().amax().float()

    def fp8_gemm_v2(
        self, *, A, trans_A, B, trans_B, D, out_dtype, A_scale_inv, B_scale_inv, bias, accumulate
    ):
        for name, operand in (("A", A), ("B", B)):
            if operand.dtype != torch.float8_e4m3fn:
                raise RuntimeError(
                    f"fp8_gemm_v2: {name} must be float8_e4m3fn, got {operand.dtype}"
                )
            peak = float(operand.float().abs().max()) if operand.numel() else 0.0
            if peak > self._fp8_range():
                raise RuntimeError(
                    f"fp8_gemm_v2: {name} holds {peak}, past {self.hardware}'s fp8 range of "
                    f"+-{self._fp8_range():g}"
                )
        assert D is None and not accumulate and out_dtype in (torch.bfloat16, torch.float32)
        a = A.float().t() if trans_A else A.float()
        b = B.float().t() if trans_B else B.float()
        if a.shape[1] != b.shape[0]:
            raise RuntimeError(f"fp8_gemm_v2: shapes {tuple(a.shape)} and {tuple(b.shape)}")
        a_scale = A_scale_inv.float()
        assert a_scale.numel() == 1 or a_scale.shape == (a.shape[0], 1), a_scale.shape
        b_scale = B_scale_inv.float()
        assert b_scale.numel() == 1 or b_scale.shape == (b.shape[1],), b_scale.shape
        self.fp8_gemms += 1
        out = (a * a_scale) @ (b * b_scale.reshape(1, -1))
        return (out if bias is None else out + bias).to(out_dtype)

    def _allocate(self, size: int) -> None:
        free, total = self.memory
        if size > free:
            raise RuntimeError(
                f"[Rank:0] FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::{size} "
                f"({free} free): device out of memory"
            )
        self.memory = (free - size, total)

    def _release(self, size: int) -> None:
        free, total = self.memory
        self.memory = (free + size, total)

    def install(self, monkeypatch) -> None:
        """Import time: the lazy mode is read now, from the environment as it is."""
        self.lazy = self.fork and os.environ.get("PT_HPU_LAZY_MODE", "0") == "1"
        self.install_metadata(monkeypatch)
        hpu = fake_module(
            "habana_frameworks.torch.hpu",
            wrap_in_hpu_graph=self.wrap_in_hpu_graph,
            synchronize=lambda: None,
            is_available=lambda: self.devices > 0,
            device_count=lambda: self.devices,
            mem_get_info=lambda: self.memory,
        )
        internal = fake_module("habana_frameworks.torch.utils.internal", is_lazy=lambda: self.lazy)
        experimental = fake_module(
            "habana_frameworks.torch.utils.experimental",
            synDeviceType=type(
                "synDeviceType",
                (),
                {
                    "synDeviceGaudi2": DEVICE_TYPES["gaudi2"],
                    "synDeviceGaudi3": DEVICE_TYPES["gaudi3"],
                },
            ),
            _get_device_type=lambda: DEVICE_TYPES.get(self.hardware, 0),
        )
        install(
            monkeypatch,
            {
                "habana_frameworks": fake_module("habana_frameworks"),
                "habana_frameworks.torch": fake_module("habana_frameworks.torch"),
                "habana_frameworks.torch.core": fake_module(
                    "habana_frameworks.torch.core", mark_step=self.mark_step
                ),
                "habana_frameworks.torch.hpu": hpu,
                "habana_frameworks.torch.utils": fake_module("habana_frameworks.torch.utils"),
                "habana_frameworks.torch.utils.internal": internal,
                "habana_frameworks.torch.utils.experimental": experimental,
                "habana_frameworks.torch.distributed": fake_module(
                    "habana_frameworks.torch.distributed"
                ),
            },
        )
        install_on_import(
            monkeypatch, "habana_frameworks.torch.distributed.hccl", self._register_hccl
        )
        # Importing the real habana_frameworks.torch registers torch.hpu and the hpu ops.
        monkeypatch.setattr(torch, "hpu", hpu, raising=False)
        ops = fake_module(
            "torch.ops.hpu", cast_to_fp8_v2=self.cast_to_fp8_v2, fp8_gemm_v2=self.fp8_gemm_v2
        )
        monkeypatch.setattr(torch.ops, "hpu", ops, raising=False)

    def install_metadata(self, monkeypatch) -> None:
        """What `pip list` shows on the image: the plugin's release and the torch build."""
        base = torch.__version__.partition("+")[0]
        versions = {
            "habana-torch-plugin": f"{self.release}.740",
            "torch": f"{base}+hpu_{self.release}-76.gitabf798b" if self.fork else base,
        }
        installed = metadata.version
        monkeypatch.setattr(metadata, "version", lambda name: versions.get(name) or installed(name))

    def _register_hccl(self, module) -> None:
        self.hccl_imported = True
