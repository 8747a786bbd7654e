"""What the chart renders is accepted by the API server: RayService and RayCluster against KubeRay's
CRD schemas (unknown fields rejected), Services and ConfigMaps against Kubernetes' own schemas."""

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helm_support, helm_values

from helm_support import crd_errors, manifests, one, require_kuberay_crds  # noqa: E402
from helm_values import VALUE_SETS  # noqa: E402

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[deploy]')")

KUBERNETES_VERSION = "1.33"  # a version current managed Kubernetes offers; the chart asks >=1.25


@pytest.fixture(autouse=True)
def _crds():
    require_kuberay_crds()


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rayservice_matches_kuberay_crd(name):
    rayservice = one(manifests(VALUE_SETS[name]), "RayService")
    assert crd_errors(rayservice, "RayService") == []


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_ray_cluster_config_matches_the_raycluster_crd(name):
    rayservice = one(manifests(VALUE_SETS[name]), "RayService")
    raycluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "demo-kvmesh"},
                  "spec": rayservice["spec"]["rayClusterConfig"]}
    assert crd_errors(raycluster, "RayCluster") == []


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_core_kinds_pass_kubernetes_validate(name):
    core = [o for o in manifests(VALUE_SETS[name]) if o["apiVersion"] in ("v1", "policy/v1", "networking.k8s.io/v1")]
    assert core, "the chart renders at least the HTTP Service"
    for obj in core:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_crd_check_rejects_unknown_and_mistyped_fields():
    """The validator itself: a misspelled field at any depth, or a wrong type, is reported with its path."""
    rayservice = one(manifests(), "RayService")
    broken = copy.deepcopy(rayservice)
    broken["spec"]["serveConfigV3"] = "x"
    cluster = broken["spec"]["rayClusterConfig"]
    cluster["workerGroupSpecs"][0]["minReplica"] = 1
    cluster["workerGroupSpecs"][0]["maxReplicas"] = "four"
    cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    errors = crd_errors(broken, "RayService")
    assert any(e.startswith("spec: Additional properties") and "serveConfigV3" in e for e in errors)
    assert any(e.startswith("spec/rayClusterConfig/workerGroupSpecs/0: Additional") and "minReplica" in e
               for e in errors)
    assert "spec/rayClusterConfig/workerGroupSpecs/0/maxReplicas: 'four' is not of type 'integer'" in errors
    assert any("containers/0: Additional properties" in e and "imagePullPolicyy" in e for e in errors)
    assert len(errors) == 4


def test_kubernetes_validate_rejects_a_bad_service():
    service = one(manifests(), "Service", "-http")
    broken = copy.deepcopy(service)
    broken["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
