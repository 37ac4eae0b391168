"""Which device the shards run on, whether it is really usable here, and what each rank may see.

The adapters say how to run on a device; this says whether the device is present. The real check
(importing the vendor stack, counting devices) runs in a throwaway child process: on Gaudi,
importing habana_frameworks can acquire the device, and a launcher holding it would lock its own
shards out. A cheap in-process look at how torch was built answers first, so a machine without the
stack gets its error at once.

`python -m engine.devices.probe cuda hpu` prints the probes as JSON (what the child runs).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from engine.errors import BucketserveError

DEVICES = ("auto", "cpu", "cuda", "hpu", "xpu")
ACCELERATORS = ("hpu", "cuda", "xpu")  # auto's order of preference
VISIBILITY_VARS = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "rocm": "HIP_VISIBLE_DEVICES",
    "hpu": "HABANA_VISIBLE_MODULES",
    "xpu": "ZE_AFFINITY_MASK",
}
PROBE_TIMEOUT_S = 120  # the first HPU initialisation of a boot is slow


class DeviceError(BucketserveError):
    """The requested device cannot be used here; the message says why in one line."""


@dataclass(frozen=True)
class Probe:
    device: str
    usable: bool
    reason: str = ""  # why not, when not usable
    count: int = 0  # devices visible to this process
    rocm: bool = False  # a ROCm build of torch answers for "cuda"


@dataclass(frozen=True)
class DevicePlan:
    """The device every shard runs on, and the device index each rank is given."""

    name: str
    visibility_var: str | None = None
    ids: tuple[str, ...] = ()
    env_extra: tuple[tuple[str, str], ...] = ()  # the same for every rank
    shared_list: bool = False  # every rank sees the whole list and takes its LOCAL_RANK-th (Habana)
    graph_mode: str | None = None  # where the launcher chose it (HPU: per Habana release)

    def env(self, rank: int) -> dict[str, str]:
        env = dict(self.env_extra)
        if self.visibility_var is not None:
            env[self.visibility_var] = ",".join(self.ids) if self.shared_list else self.ids[rank]
        return env


def _child_environment() -> dict[str, str]:
    """The environment of a child Python that must import this same engine package."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }


# --- the probes (run in the child) -------------------------------------------------------------


def probe_hpu() -> Probe:
    if importlib.util.find_spec("habana_frameworks") is None:
        return Probe(
            "hpu", False, "habana_frameworks is not installed (it ships in Habana's PyTorch images)"
        )
    import habana_frameworks.torch  # noqa: F401 - registers torch.hpu
    import torch

    if not torch.hpu.is_available():
        return Probe("hpu", False, "no Gaudi device is visible (torch.hpu.is_available() is False)")
    return Probe("hpu", True, count=torch.hpu.device_count())


def probe_cuda() -> Probe:
    import torch

    if not torch.backends.cuda.is_built():
        return Probe(
            "cuda", False, f"this torch ({torch.__version__}) is built without CUDA or ROCm"
        )
    if not torch.cuda.is_available():
        return Probe(
            "cuda", False, "no CUDA or ROCm device is visible (torch.cuda.is_available() is False)"
        )
    return Probe("cuda", True, count=torch.cuda.device_count(), rocm=torch.version.hip is not None)


def probe_xpu() -> Probe:
    import torch

    if not hasattr(torch, "xpu") or not torch.xpu._is_compiled():
        return Probe("xpu", False, f"this torch ({torch.__version__}) is built without XPU support")
    if not torch.xpu.is_available():
        return Probe(
            "xpu", False, "no Intel XPU device is visible (torch.xpu.is_available() is False)"
        )
    return Probe("xpu", True, count=torch.xpu.device_count())


PROBES = {"hpu": probe_hpu, "cuda": probe_cuda, "xpu": probe_xpu}


def safe_probe(device: str) -> Probe:
    try:
        return PROBES[device]()
    except Exception as err:  # noqa: BLE001 - a broken vendor install is an answer, not a crash
        return Probe(device, False, f"its libraries failed to load: {type(err).__name__}: {err}")


def require(device: str, before_import: Callable[[], None] = lambda: None) -> Probe:
    """The probe of a device an adapter is about to use, in this process; DeviceError when unusable.
    `before_import` runs once the stack is known to be installed, before it is first imported
    (the Habana bridge reads its environment then)."""
    found = absent_by_build(device)
    if found is None:
        before_import()
        found = safe_probe(device)
    if not found.usable:
        raise DeviceError(f"--device {device} is not usable here: {found.reason}")
    return found


# --- the launcher's side -----------------------------------------------------------------------


def absent_by_build(device: str) -> Probe | None:
    """A negative answer without touching any device: the stack is not installed or torch lacks
    it."""
    if device == "hpu":
        return probe_hpu() if importlib.util.find_spec("habana_frameworks") is None else None
    return None if _built_for(device) else safe_probe(device)


def _built_for(device: str) -> bool:
    import torch

    if device == "cuda":
        return torch.backends.cuda.is_built()
    return hasattr(torch, "xpu") and torch.xpu._is_compiled()


def probe_in_child(devices: tuple[str, ...]) -> list[Probe]:
    """The probes that need the vendor stack, run in a child so the launcher never holds a
    device."""
    command = [sys.executable, "-m", "engine.devices.probe", *devices]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=_child_environment(),
        )
    except subprocess.TimeoutExpired:
        raise DeviceError(
            f"probing {', '.join(devices)} took over {PROBE_TIMEOUT_S}s: is the device hung?"
        ) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise DeviceError(f"probing {', '.join(devices)} failed: {last}")
    return [Probe(**fields) for fields in json.loads(done.stdout.strip().splitlines()[-1])]


def probe_devices(devices: tuple[str, ...]) -> list[Probe]:
    known = {d: absent_by_build(d) for d in devices}
    unknown = tuple(d for d, p in known.items() if p is None)
    found = dict(zip(unknown, probe_in_child(unknown))) if unknown else {}
    return [known[d] or found[d] for d in devices]


def resolve_device(
    requested: str,
    num_shard: int,
    environ,
    list_adapters: Callable[[], list[str]],
    probe=probe_devices,
    warn=lambda message: None,
    graph_mode: str | None = None,
    world_size: int | None = None,
) -> DevicePlan:
    """The device plan for --device; a DeviceError (one line) when it cannot be used for num_shard
    ranks. `list_adapters` names the devices the engine has adapters for (called only when needed:
    it imports torch). `graph_mode` (--graph-mode, None: the device's default) and `world_size`
    (every rank of every node, default num_shard) decide the environment a device's runtime must
    start in (HPU)."""
    launch = Launch(graph_mode, world_size or num_shard)
    if requested not in DEVICES:
        raise DeviceError(f"unknown device {requested!r} (choose from {', '.join(DEVICES)})")
    if requested == "cpu":
        return cpu_plan(num_shard, environ)
    if requested == "auto":
        return auto_plan(probe(ACCELERATORS), num_shard, environ, list_adapters(), warn, launch)
    adapters = list_adapters()
    found = probe((requested,))[0]
    if not found.usable:
        raise DeviceError(f"--device {requested} is not usable here: {found.reason}")
    if requested not in adapters:
        raise DeviceError(
            f"--device {requested}: the device is present but this engine has no {requested} "
            f"adapter yet (available: {', '.join(adapters)})"
        )
    return plan_for(found, num_shard, environ, launch)


@dataclass(frozen=True)
class Launch:
    """What the device's environment depends on besides the device: --graph-mode and the ranks."""

    graph_mode: str | None = None
    world_size: int = 1


def auto_plan(
    found: list[Probe], num_shard: int, environ, adapters: list[str], warn, launch: Launch
) -> DevicePlan:
    usable = [p for p in found if p.usable]
    for p in usable:
        if p.device in adapters:
            return plan_for(p, num_shard, environ, launch)
        warn(
            f"a {p.device} device is present but this engine has no {p.device} adapter yet: not "
            "using it"
        )
    return cpu_plan(num_shard, environ)


def plan_for(found: Probe, num_shard: int, environ, launch: Launch = Launch()) -> DevicePlan:
    var = VISIBILITY_VARS["rocm" if found.rocm else found.device]
    if found.count < num_shard:
        raise DeviceError(
            f"--num-shard {num_shard} needs {num_shard} {found.device} devices, {found.count} "
            "visible"
        )
    # Honour a list the user already narrowed (CUDA_VISIBLE_DEVICES=2,3): rank r gets its r-th
    # entry.
    preset = [i.strip() for i in environ.get(var, "").split(",") if i.strip()]
    ids = (
        tuple(preset[:num_shard])
        if len(preset) >= num_shard
        else tuple(str(r) for r in range(num_shard))
    )
    if found.device == "hpu":
        return hpu_plan(
            tuple(preset[:num_shard]) if len(preset) >= num_shard else (), launch, environ
        )
    return DevicePlan(found.device, var, ids)


def hpu_plan(ids: tuple[str, ...], launch: Launch, environ) -> DevicePlan:
    """Habana's process assignment: each shard acquires a Gaudi by its LOCAL_RANK (the launcher sets
    it) among those the container sees (HABANA_VISIBLE_DEVICES, which Docker's Habana runtime and
    Kubernetes' device plugin set to whatever cards they hand out). HABANA_VISIBLE_MODULES lists
    module ids, which are the host's, not 0..N-1 of the container: as TGI and vllm-gaudi, the
    launcher sets none of its own, and passes a list the user set (`ids`) to every process whole.
    The bridge's mode must be in the environment before a shard imports torch: the graph mode asked
    for, else the installed release's default (engine/devices/hpu/release.py), which the shards are
    then given too; lazy mode on an image without it is refused here, before any shard starts."""
    from engine.config import default_cache_dir
    from engine.devices.hpu.release import installed_stack
    from engine.devices.hpu.vars import launch_environment

    stack = installed_stack()
    graph_mode = launch.graph_mode or stack.default_graph_mode(environ)
    problem = stack.mode_problem(graph_mode)
    if problem is not None:
        raise DeviceError(problem)
    variables = launch_environment(graph_mode, launch.world_size, default_cache_dir(), environ)
    extra = tuple(sorted(variables.items()))
    if not ids:
        return DevicePlan("hpu", None, (), extra, graph_mode=graph_mode)
    return DevicePlan(
        "hpu", VISIBILITY_VARS["hpu"], ids, extra, shared_list=True, graph_mode=graph_mode
    )


def cpu_plan(num_shard: int, environ) -> DevicePlan:
    """CPU shards share the cores: without a split, N ranks each start a thread per core and
    thrash."""
    if "OMP_NUM_THREADS" in environ or num_shard == 1:
        return DevicePlan("cpu")
    threads = max(1, len(os.sched_getaffinity(0)) // num_shard)
    return DevicePlan("cpu", env_extra=(("OMP_NUM_THREADS", str(threads)),))


def main(devices: list[str]) -> None:
    print(json.dumps([asdict(safe_probe(d)) for d in devices]))


if __name__ == "__main__":
    main(sys.argv[1:])
