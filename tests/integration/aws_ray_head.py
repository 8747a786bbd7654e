"""A Ray head started on 127.0.0.1 with exactly the environment of deploy/aws.yaml's head `ray start`
(token auth with $HOME/.ray/auth_token, where file_mounts puts the token; the setup hook variable),
in a PID namespace of its own (test_fake_cluster.PidNamespace), so that nothing here can stop
another Ray on the machine."""

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # deploy_support

from deploy_support import load, ray_start_commands, ray_start_env  # noqa: E402
from kvmesh.cluster.local import free_port  # noqa: E402
from test_fake_cluster import PidNamespace  # noqa: E402


@dataclass
class RayHead:
    namespace: PidNamespace
    gcs_port: int
    home: Path  # the node's $HOME
    token: str  # in home/.ray/auth_token
    env: dict  # this process's environment without the variables left out, with HOME set to `home`
    ray: str  # the `ray` executable

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def shell_env(self) -> dict:
        """A client's on the node, as deploy/aws.yaml's ~/.bashrc line sets it: the token file only."""
        return self.env | {"RAY_AUTH_MODE": "token",
                           "RAY_AUTH_TOKEN_PATH": str(self.home / ".ray" / "auth_token")}


@contextmanager
def aws_ray_head(tmp_path: Path, ray_start_args: list[str], leave_out_env: tuple[str, ...],
                 leave_out_head_env: tuple[str, ...] = ()):
    """The head, started with `ray_start_args` added; the variables named by a prefix in
    `leave_out_env` do not reach it, nor those of aws.yaml's head environment in `leave_out_head_env`
    (each must be there)."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    token = secrets.token_hex(32)
    (home / ".ray" / "auth_token").write_text(token)  # where file_mounts puts the operator's token
    head_env = {name: value.replace("$HOME", str(home))
                for name, value in ray_start_env(ray_start_commands(load("aws.yaml"))["head"]).items()}
    for name in leave_out_head_env:
        del head_env[name]
    gcs_port = free_port()
    ray_temp = tempfile.mkdtemp(prefix="kvh")  # Ray's socket paths must stay short
    env = {name: value for name, value in os.environ.items() if not name.startswith(leave_out_env)}
    env |= {"HOME": str(home), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    namespace = PidNamespace()
    ray = str(Path(sys.executable).with_name("ray"))
    try:
        start = subprocess.run(namespace.command([
            ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
            f"--object-store-memory={100 << 20}", f"--temp-dir={ray_temp}", *ray_start_args]),
            env=env | head_env, capture_output=True, text=True, timeout=180)
        assert start.returncode == 0, start.stdout + start.stderr
        yield RayHead(namespace, gcs_port, home, token, env, ray)
    finally:
        namespace.close()
        shutil.rmtree(ray_temp, ignore_errors=True)
