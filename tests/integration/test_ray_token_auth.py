"""Ray's token authentication as the `ray up` configs turn it on (docs/DEPLOY.md, "Network model").

A Ray head starts on 127.0.0.1 with exactly the environment of deploy/aws.yaml's head `ray start`
(RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH=$HOME/.ray/auth_token, where file_mounts puts the
token), in a PID namespace of its own (test_fake_cluster.PidNamespace) so that nothing here can
stop another Ray on the machine. Then: the dashboard and the dashboard agent refuse a caller
without the token (their health checks stay open), the GCS refuses a wrong token, the metrics
port needs none, and a client with the token file of deploy/aws.yaml's `~/.bashrc` line gets
through. The dashboard's open paths are its login page, its static files and its health checks;
Ray's job API behind it takes `ray job submit` with the token (DEPLOY.md's command) and refuses it
without.
"""

import re
import secrets
import subprocess
import urllib.error
import urllib.request

import pytest

from aws_ray_head import aws_ray_head
from kvmesh.cluster.local import free_port
from test_fake_cluster import wait_for

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
    ports = {name: free_port() for name in ("dashboard", "client", "agent", "metrics")}
    with aws_ray_head(tmp_path, [
            "--num-cpus=1", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
            f"--ray-client-server-port={ports['client']}", f"--dashboard-agent-listen-port={ports['agent']}",
            f"--metrics-export-port={ports['metrics']}"], leave_out_env=("RAY_AUTH",)) as head:
        yield head, ports | {"gcs": head.gcs_port}


def test_the_ray_up_head_environment_makes_every_ray_port_ask_for_the_token(token_cluster):
    head, ports = token_cluster
    token, env, ray = head.token, head.env, head.ray
    dashboard = f"http://127.0.0.1:{ports['dashboard']}/api/version"
    wait_for("the dashboard", lambda: http_status(dashboard) != 0, 60)
    assert http_status(dashboard) == 401
    assert http_status(dashboard, {"Authorization": f"Bearer {token}"}) == 200
    assert http_status(f"http://127.0.0.1:{ports['metrics']}/metrics") == 200  # Prometheus: no token
    agent = f"http://127.0.0.1:{ports['agent']}"
    wait_for("the dashboard agent", lambda: http_status(f"{agent}/api/local_raylet_healthz") == 200, 60)
    assert http_status(f"{agent}/api/v0/anything") == 401

    def ray_status(extra_env: dict) -> subprocess.CompletedProcess:
        return subprocess.run(head.namespace.command([ray, "status", f"--address=127.0.0.1:{ports['gcs']}"]),
                              env=env | extra_env, capture_output=True, text=True, timeout=120)

    refused = ray_status({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]
    # What a `ray exec` shell on a node runs with: deploy/aws.yaml's ~/.bashrc line.
    admitted = ray_status(head.shell_env)
    assert admitted.returncode == 0 and "Active:" in admitted.stdout, admitted.stderr[-2000:]


def test_the_dashboard_opens_only_its_login_page_static_files_and_health_checks(token_cluster):
    head, ports = token_cluster
    base = f"http://127.0.0.1:{ports['dashboard']}"
    wait_for("the dashboard", lambda: http_status(f"{base}/api/version") != 0, 60)
    with urllib.request.urlopen(f"{base}/", timeout=10) as response:  # the login page, no token
        page = response.read().decode()
    static = re.findall(r'(?:src|href)="\./(static/[^"]+)"', page)
    assert static, page[:500]
    for path in ["favicon.ico", *static, "api/gcs_healthz"]:
        assert http_status(f"{base}/{path}") == 200, path
    bearer = {"Authorization": f"Bearer {head.token}"}
    for path in ("api/jobs/", "api/version", "api/serve/applications/", "api/cluster_status", "nodes?view=summary"):
        assert http_status(f"{base}/{path}") == 401, path
        assert http_status(f"{base}/{path}", bearer) == 200, path


def test_ray_job_submit_through_the_dashboard_needs_the_token(token_cluster):
    """DEPLOY.md: `RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<the token file> ray job submit --address
    http://127.0.0.1:8265 -- ...` (here the dashboard's port on the loopback, as `ray dashboard`
    forwards it)."""
    head, ports = token_cluster
    base = f"http://127.0.0.1:{ports['dashboard']}"
    wait_for("the dashboard", lambda: http_status(f"{base}/api/version") != 0, 60)

    def submit(env: dict) -> subprocess.CompletedProcess:
        return subprocess.run(head.namespace.command([head.ray, "job", "submit", "--address", base, "--",
                                                      "echo", "kvmesh-job-ran"]),
                              env=env, capture_output=True, text=True, timeout=180)

    refused = submit(head.env)  # the token file is in $HOME/.ray, but token mode is not on
    assert refused.returncode != 0 and "Unauthorized" in refused.stderr, refused.stderr[-2000:]
    admitted = submit(head.shell_env)
    assert admitted.returncode == 0, admitted.stderr[-2000:]
    assert "kvmesh-job-ran" in admitted.stdout and "succeeded" in admitted.stdout, admitted.stdout[-2000:]
