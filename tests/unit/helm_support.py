"""Render the kvmesh chart offline and validate what it renders, for the test_helm_* files.

Helm runs in-process through helm-python-sdk (Helm v4's Go SDK behind a C ABI), so no helm
binary and no cluster are needed. KubeRay's CRDs come from `<repo>/../shared/k8s/kuberay-crds/`;
tests that need them skip with a reason naming the missing path.
"""

import copy
import functools
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kvmesh"
KUBERAY_CRDS = REPO.parent / "shared" / "k8s" / "kuberay-crds"
RELEASE = "demo"
NAMESPACE = "llm"

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk is not installed (pip install -e '.[deploy]')")


def render(values: dict | None = None, release: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text, as `helm template RELEASE helm/kvmesh -n llm` gives it."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(values=values, name=release, namespace=NAMESPACE, is_install=True)


def manifests(values: dict | None = None, release: str = RELEASE) -> list[dict]:
    """Every Kubernetes object the chart renders (NOTES.txt and empty templates left out)."""
    objects = []
    for path, text in sorted(render(values, release).items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def one(objects: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def require_kuberay_crds() -> Path:
    if not (KUBERAY_CRDS / "ray.io_rayservices.yaml").is_file():
        pytest.skip(f"KubeRay CRD schemas not found at {KUBERAY_CRDS} (shared/ is absent)")
    return KUBERAY_CRDS


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str, version: str = "v1") -> dict:
    """The openAPIV3Schema of a KubeRay kind, made strict as the API server treats it: an object
    with declared properties rejects unknown fields (structural schemas prune them on write, and
    `kubectl apply --validate=strict` rejects them), int-or-string accepts both, nullable admits null."""
    crd_dir = require_kuberay_crds()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((crd_dir / f"ray.io_{kind.lower()}s.yaml").read_text(), Loader=loader)
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return _strict(copy.deepcopy(entry["schema"]["openAPIV3Schema"]))
    raise KeyError(f"{kind} has no version {version}")


def _strict(node):
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _strict(value) if key not in ("enum", "default", "example") else value
            for key, value in node.items()}
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("type", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        node["additionalProperties"] = False
    return node


def crd_errors(obj: dict, kind: str) -> list[str]:
    """Messages of every violation of KubeRay's schema for `kind`, with the path to each."""
    validator = _validator(kind)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


@functools.lru_cache(maxsize=None)
def _validator(kind: str):
    import jsonschema

    return jsonschema.Draft7Validator(crd_schema(kind))
