"""The Habana runtime's environment.

The bridge reads PT_HPU_LAZY_MODE once, when it is imported, and current releases import it with
`import torch` (torch's device-backend autoload), so a shard cannot choose its mode itself: the
launcher puts these variables in each shard's environment (DevicePlan), a value the user already
set wins, and the adapter checks after import that the bridge really runs in the mode its graph
mode needs. The other variables are read when the runtime initialises; the adapter also sets them
(if absent) before its first import, for an engine started without the launcher.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from engine.devices.probe import DeviceError


def apply_environment(wanted: dict[str, str], environ: MutableMapping[str, str]) -> None:
    current = environ.get("PT_HPU_LAZY_MODE")
    if current is not None and current != wanted["PT_HPU_LAZY_MODE"]:
        raise DeviceError(
            _mode_message(wanted["PT_HPU_LAZY_MODE"] == "1", f"PT_HPU_LAZY_MODE={current} is set")
        )
    for key, value in wanted.items():
        environ.setdefault(key, value)


def check_bridge_mode(htorch, lazy: bool, graph_mode: str) -> None:
    """The mode the bridge started in (it read PT_HPU_LAZY_MODE at import) against the one we
    need."""
    running = bool(htorch.utils.internal.is_lazy())
    if running != lazy:
        started = "lazy" if running else "eager"
        raise DeviceError(
            _mode_message(lazy, f"the Habana bridge started in {started} mode", graph_mode)
        )


def _mode_message(lazy: bool, found: str, graph_mode: str | None = None) -> str:
    needed = "lazy mode" if lazy else "eager mode (compile)"
    value = "1" if lazy else "0"
    which = f"--graph-mode {graph_mode}" if graph_mode else "--graph-mode"
    return (
        f"{which} needs the Habana bridge in {needed}, but {found}: set PT_HPU_LAZY_MODE={value} "
        "in the environment before the engine starts (the bridge reads it when torch is "
        "imported; the launcher sets it for its shards) or choose another --graph-mode"
    )
