"""The ray up configs' own setup commands, run as `ray up` runs them on a fresh head node.

A node is a temporary HOME. `ray up` copies this checkout there (file_mounts "~/kvmesh" with the
YAML's rsync_exclude; copied here by the same patterns), puts the Ray token file in place, then runs
setup_commands and head_setup_commands one by one, each through Ray's own login-shell wrapper
(`ray.autoscaler._private.command_runner._with_interactive`: `bash --login -c -i "source ~/.bashrc;
... (cmd)"`), which resets PATH to the system's as an SSH login does. Then the head's kvmesh must
load and run the default model, and `ray`, `kvmesh` and the cloud provider's library must be the
virtual environment's.

What differs from a cloud node, each because this machine reaches PyPI and nothing else:
- uv and a CPython are already in ~/.local/bin (where uv's installer puts uv), so the `curl ...
  install.sh` fallback is not taken and uv makes the venv from that CPython (UV_PYTHON_DOWNLOADS=never);
- that CPython is 3.11, not 3.12, and the torch line installs the CPU wheel that lies on this
  machine's disk (cp311) instead of torch 2.11.0 from download.pytorch.org (PyPI's Linux torch is
  a CUDA build of several GB). Both substitutions are made on the command text and asserted to
  have happened, so a changed command fails here instead of being skipped;
- the GPU workers' install (CUDA torch, the gpu extra) is resolved, not installed (`--dry-run`).
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TORCH_LINE = re.compile(r"torch==\S+ --index-url \S+")
TIMEOUT_S = 900


def _local_torch_wheel() -> str | None:
    dirs = [d for d in os.environ.get("PIP_FIND_LINKS", "").split() if d] + ["/opt/wheels"]
    for d in dirs:
        found = sorted(glob.glob(os.path.join(d, "torch-2.13.0*cp311*.whl")))
        if found:
            return found[0]
    return None


def _excluded(rel: str, patterns: list[str]) -> bool:
    """rsync's `--exclude` for the patterns the configs use ("**/NAME", "**/*.suffix"): a path
    component matching NAME is left out, with everything under it."""
    parts = rel.split("/")
    return any(fnmatch.fnmatch(part, p[3:] if p.startswith("**/") else p) for p in patterns for part in parts)


def _copy_checkout(dest: Path, excludes: list[str]) -> None:
    def ignore(folder, names):
        rel = os.path.relpath(folder, REPO)
        return [n for n in names if _excluded(os.path.normpath(os.path.join(rel, n)), excludes)]
    shutil.copytree(REPO, dest, ignore=ignore, symlinks=True)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    uv = shutil.which("uv") or (Path(sys.executable).parent / "uv")
    if not Path(uv).exists():
        pytest.skip("uv is not installed (pip install -e '.[test]')")
    wheel = _local_torch_wheel()
    if wheel is None:
        pytest.skip("no local CPU torch 2.13.0 wheel for Python 3.11 (/opt/wheels); needed instead of "
                    "download.pytorch.org, which this machine does not reach")
    home = tmp_path_factory.mktemp("head-node")
    (home / ".local" / "bin").mkdir(parents=True)
    os.symlink(uv, home / ".local" / "bin" / "uv")
    os.symlink(os.path.realpath(sys.base_prefix + "/bin/python3.11"), home / ".local" / "bin" / "python3.11")
    return home, wheel


def _run(home: Path, cmd: str) -> subprocess.CompletedProcess:
    from ray.autoscaler._private.command_runner import _with_interactive

    env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
           "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": str(home / ".cache" / "uv"),
           "HF_HUB_OFFLINE": "1", "TERM": "dumb"}
    for key in ("SSL_CERT_FILE", "PIP_CERT", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY",
                "https_proxy", "http_proxy", "no_proxy"):
        if key in os.environ:
            env[key] = os.environ[key]
    env.setdefault("SSL_CERT_FILE", env.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt"))
    argv = _with_interactive(cmd)  # ["bash", "--login", "-c", "-i", quoted]
    shell = " ".join(argv[:4]) + " " + argv[4]
    return subprocess.run(shell, shell=True, env=env, cwd=home, capture_output=True, text=True,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


def _check(home: Path, cmd: str) -> str:
    out = _run(home, cmd)
    assert out.returncode == 0, f"{cmd!r} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _as_here(cmd: str, wheel: str) -> str:
    """The command with this machine's two substitutions (module docstring)."""
    return TORCH_LINE.sub(wheel, cmd.replace("--python 3.12", "--python 3.11"))


@pytest.mark.parametrize("config", ["aws.yaml", "gcp.yaml"])
def test_setup_commands_make_a_head_that_serves_the_default_model(node, config):
    home, wheel = node
    cfg = yaml.safe_load((REPO / "deploy" / config).read_text())
    # file_mounts: the checkout, then the token (DEPLOY.md: ~/.ray/kvmesh_auth_token on your machine)
    assert cfg["file_mounts"]["~/kvmesh"] == "."
    checkout = home / "kvmesh"
    if not checkout.exists():  # one node: the second config updates it, as `ray up` on a running head
        _copy_checkout(checkout, cfg["rsync_exclude"])
    for left_out in (".git", ".venv"):
        assert not (checkout / left_out).exists(), f"{left_out} reached the node"
    assert (checkout / "pyproject.toml").is_file()
    (home / ".ray").mkdir(exist_ok=True)
    (home / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)

    commands = cfg["setup_commands"] + cfg["head_setup_commands"]
    substituted = [_as_here(c, wheel) for c in commands]
    assert any("--python 3.11" in c for c in substituted), "the venv command changed: update this test"
    assert sum(wheel in c for c in substituted) == 1, "the head's torch command changed: update this test"
    for cmd in substituted:
        _check(home, cmd)
    # `ray up` runs them again on every update: nothing is appended twice
    for cmd in substituted[:2]:
        _check(home, cmd)
    bashrc = (home / ".bashrc").read_text().splitlines()
    assert len(bashrc) == len(set(bashrc)) == 2, bashrc

    # what a `ray exec` / `ray attach` shell and the head's start commands see
    env = _check(home, "command -v ray kvmesh python; echo $RAY_AUTH_MODE $RAY_AUTH_TOKEN_PATH").split()
    venv_bin = str(home / "kvmesh-venv" / "bin")
    assert env[:3] == [f"{venv_bin}/ray", f"{venv_bin}/kvmesh", f"{venv_bin}/python"], env
    assert env[3:] == ["token", str(home / ".ray" / "auth_token")]
    provider_lib = {"aws.yaml": "boto3", "gcp.yaml": "googleapiclient"}[config]
    _check(home, f"python -c 'import {provider_lib}, ray.serve, kvmesh.cluster.app'")
    text = _check(home, "cd ~ && kvmesh generate 'What is the capital of France?' --max-tokens 12")
    assert "Paris" in text


@pytest.mark.parametrize("config", ["aws.yaml", "gcp.yaml"])
def test_worker_setup_commands_resolve_cuda_torch_and_the_gpu_kernels(node, config):
    """The GPU workers' installs, resolved against the real indexes' metadata where this machine
    reaches them: the gpu extra (flashinfer, triton) on the venv's Python."""
    home, wheel = node
    if not (home / "kvmesh-venv" / "bin" / "python").exists():
        pytest.skip("the head's setup did not run (see the test above)")
    cfg = yaml.safe_load((REPO / "deploy" / config).read_text())
    (torch_cmd, kvmesh_cmd) = cfg["worker_setup_commands"]
    assert TORCH_LINE.search(torch_cmd) and "cu128" in torch_cmd
    assert kvmesh_cmd.endswith('-e "$HOME/kvmesh[serve,gpu]"')
    out = _run(home, _as_here(kvmesh_cmd, wheel) + " --dry-run")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "flashinfer-python" in out.stdout + out.stderr  # uv reports what it would install
