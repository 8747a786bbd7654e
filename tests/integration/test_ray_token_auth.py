"""Ray's token authentication as the `ray up` configs turn it on (docs/DEPLOY.md, "Network model").

A Ray head starts on 127.0.0.1 with exactly the environment of deploy/aws.yaml's head `ray start`
(RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH=$HOME/.ray/auth_token, where file_mounts puts the
token), in a PID namespace of its own (test_fake_cluster.PidNamespace) so that nothing here can
stop another Ray on the machine. Then: the dashboard and the dashboard agent refuse a caller
without the token (their health checks stay open), the GCS refuses a wrong token, the metrics
port needs none, and a client with the token file of deploy/aws.yaml's `~/.bashrc` line gets
through.
"""

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # deploy_support

from deploy_support import load, ray_start_commands, ray_start_env  # noqa: E402
from test_fake_cluster import PidNamespace, free_port, wait_for  # noqa: E402

pytestmark = pytest.mark.slow


def http_status(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return 0


@pytest.fixture
def token_cluster(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    token = secrets.token_hex(32)
    (home / ".ray" / "auth_token").write_text(token)  # where file_mounts puts the operator's token
    head_env = {name: value.replace("$HOME", str(home))
                for name, value in ray_start_env(ray_start_commands(load("aws.yaml"))["head"]).items()}
    ports = {name: free_port() for name in ("gcs", "dashboard", "client", "agent", "metrics")}
    ray_temp = tempfile.mkdtemp(prefix="kva")  # Ray's socket paths must stay short
    base_env = {name: value for name, value in os.environ.items() if not name.startswith("RAY_AUTH")}
    base_env |= {"HOME": str(home), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    namespace = PidNamespace()
    ray = str(Path(sys.executable).with_name("ray"))
    try:
        start = subprocess.run(namespace.command([
            ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={ports['gcs']}", "--num-cpus=1",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
            f"--ray-client-server-port={ports['client']}", f"--dashboard-agent-listen-port={ports['agent']}",
            f"--metrics-export-port={ports['metrics']}", f"--object-store-memory={100 << 20}",
            f"--temp-dir={ray_temp}"]),
            env=base_env | head_env, capture_output=True, text=True, timeout=180)
        assert start.returncode == 0, start.stdout + start.stderr
        yield {"ports": ports, "token": token, "env": base_env, "home": home, "ray": ray, "namespace": namespace}
    finally:
        namespace.close()
        shutil.rmtree(ray_temp, ignore_errors=True)


def test_the_ray_up_head_environment_makes_every_ray_port_ask_for_the_token(token_cluster):
    ports, token, env, ray = (token_cluster[k] for k in ("ports", "token", "env", "ray"))
    dashboard = f"http://127.0.0.1:{ports['dashboard']}/api/version"
    wait_for("the dashboard", lambda: http_status(dashboard) != 0, 60)
    assert http_status(dashboard) == 401
    assert http_status(dashboard, {"Authorization": f"Bearer {token}"}) == 200
    assert http_status(f"http://127.0.0.1:{ports['metrics']}/metrics") == 200  # Prometheus: no token
    agent = f"http://127.0.0.1:{ports['agent']}"
    wait_for("the dashboard agent", lambda: http_status(f"{agent}/api/local_raylet_healthz") == 200, 60)
    assert http_status(f"{agent}/api/v0/anything") == 401

    def ray_status(extra_env: dict) -> subprocess.CompletedProcess:
        return subprocess.run(token_cluster["namespace"].command([ray, "status", f"--address=127.0.0.1:{ports['gcs']}"]),
                              env=env | extra_env, capture_output=True, text=True, timeout=120)

    refused = ray_status({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]
    # What a `ray exec` shell on a node runs with: deploy/aws.yaml's ~/.bashrc line.
    bashrc = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_cluster["home"] / ".ray" / "auth_token")}
    admitted = ray_status(bashrc)
    assert admitted.returncode == 0 and "Active:" in admitted.stdout, admitted.stderr[-2000:]
