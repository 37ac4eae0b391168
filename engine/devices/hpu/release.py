"""Which Habana software is installed, and the graph mode it serves by default.

Read from the installed packages' metadata, never by importing the bridge (an import can acquire
a Gaudi, and the launcher must not hold one): the release is habana-torch-plugin's version
("1.22.0.740", as optimum-habana reads it), and lazy mode exists only in Habana's fork of torch,
whose version names it ("2.6.0+hpu_1.21.2-76.gitabf798b"). The upstream-PyTorch images carry
torch's own builds ("2.9.0", "2.9.0+cpu"), in which the bridge runs eagerly whatever
PT_HPU_LAZY_MODE says. From 1.23 Habana's default is eager with torch.compile (PT_HPU_LAZY_MODE=0;
Theory of Operations: lazy mode "a legacy fallback"), which is ours there too; 1.21 and 1.22 keep
lazy mode with HPU graphs. Imports vars.py alone, as the launcher reads it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

from engine.devices.hpu.vars import LAZY_MODES

COMPILE_DEFAULT_SINCE = (1, 23)
UPSTREAM_BUILDS = re.compile(r"(cpu|cu\d+|rocm[\d.]+|xpu)?")  # torch's own local version tags


@dataclass(frozen=True)
class HabanaStack:
    release: tuple[int, int] | None  # (major, minor) of habana-torch-plugin; None: not found
    lazy_mode: bool  # the installed torch is Habana's fork, which has lazy mode

    def default_graph_mode(self, environ: Mapping[str, str]) -> str:
        """A PT_HPU_LAZY_MODE the user set picks the mode; else the release's default."""
        if not self.lazy_mode or environ.get("PT_HPU_LAZY_MODE") == "0":
            return "compile"
        if "PT_HPU_LAZY_MODE" in environ:
            return "graphs"
        if self.release is not None and self.release >= COMPILE_DEFAULT_SINCE:
            return "compile"
        return "graphs"

    def mode_problem(self, graph_mode: str) -> str | None:
        """Why this stack cannot run `graph_mode`, in one line; None when it can."""
        if graph_mode in LAZY_MODES and not self.lazy_mode:
            return (
                f"--graph-mode {graph_mode} needs Habana's lazy mode, which this image's torch "
                f"({_version('torch')}, not Habana's fork) does not have: use --graph-mode compile"
            )
        return None


def installed_stack() -> HabanaStack:
    return HabanaStack(_release(_version("habana-torch-plugin")), _is_fork(_version("torch")))


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str | None) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(found[1]), int(found[2])) if found else None


def _is_fork(torch_version: str | None) -> bool:
    """Habana's builds of torch carry a local version of their own ("+hpu_1.21.2-76.git...");
    a torch without one, or with one of torch's own build tags, is upstream's."""
    if torch_version is None:
        return False
    local = torch_version.partition("+")[2]
    return UPSTREAM_BUILDS.fullmatch(local) is None
