"""deploy/kubernetes/ validates: built-in kinds against the Kubernetes schemas (kubernetes-validate,
strict: an unknown field is an error), LeaderWorkerSet and InferencePool against their CRDs' schemas
(vendored in deploy/kubernetes/schemas/), the LeaderWorkerSet's pod templates as PodTemplateSpecs."""

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"  # preStop `sleep` needs 1.30 or later
CRDS = {
    "LeaderWorkerSet": "leaderworkerset-v1.json",
    "InferencePool": "inferencepool-v1.json",
}


def documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def check(document: dict) -> None:
    kind = document["kind"]
    if kind not in CRDS:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
        return
    schema = json.loads((DEPLOY / "schemas" / CRDS[kind]).read_text())
    jsonschema.validate(document, schema)
    if kind == "LeaderWorkerSet":
        template = document["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key}}
            kubernetes_validate.validate({**pod, "template": template[key]}, K8S_VERSION, True)


@pytest.mark.parametrize(
    "name, document", documents(), ids=lambda x: x if isinstance(x, str) else x["kind"]
)
def test_every_manifest_validates(name, document):
    check(document)


def test_the_manifests_hold_what_a_fleet_needs():
    kinds = {doc["kind"] for _, doc in documents()}
    assert {"StatefulSet", "LeaderWorkerSet", "InferencePool", "Deployment", "Service"} <= kinds


@pytest.mark.parametrize(
    "kind, path, bad",
    [
        (
            "StatefulSet",
            ("spec", "template", "spec", "containers", 0, "startupProbe"),
            {"httpGet": 1},
        ),
        ("StatefulSet", ("spec", "template", "spec", "containers", 0, "portz"), []),
        ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "restartPolicy"), "Always"),
        ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "workerTemplate", "spec", "x"), 1),
        ("InferencePool", ("spec", "targetPorts"), [{"number": 70000}]),
    ],
)
def test_a_broken_manifest_is_refused(kind, path, bad):
    document = json.loads(json.dumps(next(d for _, d in documents() if d["kind"] == kind)))
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = bad
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        check(document)
