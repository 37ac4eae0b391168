"""torch.distributed as an accelerator backend sees it, on real gloo processes.

The ranks really communicate (gloo under the hood), but a group initialised for "hccl", "nccl" or
"xccl" refuses CPU tensors as the real ones do: in torch/csrc/distributed/c10d/ProcessGroup.hpp,
getBackend(DeviceType::CPU) on a group with only a device backend raises "No backend type
associated with device type cpu" (pytorch/pytorch v2.6.0, c10d ProcessGroup::getBackend). A group
made with new_group(backend="gloo") takes CPU tensors.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_gather_into_tensor")


class StrictBackend:
    """Patches torch.distributed in this process: the default group answers to `declared`."""

    def __init__(self, declared: str):
        self.declared = declared
        self.gloo_groups: list = []
        self.real = {
            name: getattr(dist, name) for name in ("init_process_group", "new_group", *COLLECTIVES)
        }

    def apply(self) -> None:
        dist.init_process_group = self.init_process_group
        dist.new_group = self.new_group
        for name in COLLECTIVES:
            setattr(dist, name, self._checked(name))

    def init_process_group(self, backend=None, **kwargs):
        assert backend == self.declared, (
            f"init_process_group({backend!r}), this process runs {self.declared!r}"
        )
        kwargs.setdefault(
            "timeout", timedelta(seconds=60)
        )  # a rank that failed must not hang the other
        return self.real["init_process_group"](backend="gloo", **kwargs)

    def new_group(self, ranks=None, backend=None, **kwargs):
        group = self.real["new_group"](ranks=ranks, backend="gloo", **kwargs)
        if backend == "gloo":
            self.gloo_groups.append(group)
        return group

    def _checked(self, name):
        real = self.real[name]

        def collective(*args, group=None, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [
                t
                for a in args
                if isinstance(a, (list, tuple))
                for t in a
                if isinstance(t, torch.Tensor)
            ]
            if self.declared != "gloo" and not any(group is g for g in self.gloo_groups):
                if any(t.device.type == "cpu" for t in tensors):
                    raise RuntimeError("No backend type associated with device type cpu")
            return real(*args, group=group, **kwargs)

        return collective


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn, rank, world_size, backend, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        StrictBackend(backend).apply()
        results.put((rank, "ok", fn(rank, world_size, backend, port)))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn, world_size: int, backend: str, timeout: float = 120
) -> dict[int, tuple[str, object]]:
    """fn(rank, world_size, backend, port) in `world_size` fresh processes; rank -> ("ok", value) or
    ("error", message). `fn` must be importable (a module-level function)."""
    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), free_port()
    processes = [
        context.Process(target=_rank_main, args=(fn, r, world_size, backend, port, results))
        for r in range(world_size)
    ]
    for process in processes:
        process.start()
    out = {}
    try:
        for _ in processes:
            rank, status, value = results.get(timeout=timeout)
            out[rank] = (status, value)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return out
