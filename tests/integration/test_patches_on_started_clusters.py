"""The worker hook's patches (cluster/ray_patches.py) on a Ray cluster that `kvmesh serve` did not
start (docs/SERVING.md "What the patches cover"; docs/DEPLOY.md).

A Ray head starts on 127.0.0.1 with exactly the environment of deploy/aws.yaml's head `ray start`
(its NODE_ENV included), in a PID namespace of its own (test_fake_cluster.PidNamespace), as
test_ray_token_auth.py starts it. Then a plain driver, which sets no runtime_env and no kvmesh
variable, starts Serve's proxies as `serve deploy` or KubeRay's RayService would: the HTTP proxy
answers a request head over 64 KiB with 431, a limit only the patch gives it (Serve's own proxy
reads the whole head and answers it, here 404: no app). Without the node's hook variable, the same
head gets 404 from the same kind of cluster, so the variable is what brings the limit.
"""

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # deploy_support
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # raw_http

from deploy_support import load, ray_start_commands, ray_start_env  # noqa: E402
from raw_http import connect, request  # noqa: E402
from test_fake_cluster import PidNamespace, free_port  # noqa: E402

from kvmesh.cluster.ray_patches import SETUP_HOOK_ENV  # noqa: E402

pytestmark = pytest.mark.slow

MAX_HEADER_BYTES = 65_536  # server.max_header_bytes's default, what the patch applies unset

# Serve's proxies as a deployment tool starts them: no runtime_env, nothing of kvmesh.
DRIVER = """
import sys
import ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="WARNING")
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})
print("proxies started", flush=True)
"""


@pytest.fixture(params=["node env of deploy/aws.yaml", "without the hook variable"])
def serve_on_started_cluster(request, tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    head_env = {name: value.replace("$HOME", str(home))
                for name, value in ray_start_env(ray_start_commands(load("aws.yaml"))["head"]).items()}
    if request.param == "without the hook variable":
        del head_env[SETUP_HOOK_ENV]
    gcs_port, http_port = free_port(), free_port()
    ray_temp = tempfile.mkdtemp(prefix="kvp")  # Ray's socket paths must stay short
    base_env = {name: value for name, value in os.environ.items()
                if not name.startswith(("RAY_", "KVMESH_", "__RAY"))}
    base_env |= {"HOME": str(home), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    namespace = PidNamespace()
    ray = str(Path(sys.executable).with_name("ray"))
    try:
        start = subprocess.run(namespace.command([
            ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}", "--num-cpus=2",
            "--include-dashboard=false", f"--object-store-memory={100 << 20}", f"--temp-dir={ray_temp}"]),
            env=base_env | head_env, capture_output=True, text=True, timeout=180)
        assert start.returncode == 0, start.stdout + start.stderr
        # the driver is a client of the cluster, as on a node's shell: the token, not the hook
        client_env = base_env | {"RAY_AUTH_MODE": "token",
                                 "RAY_AUTH_TOKEN_PATH": str(home / ".ray" / "auth_token")}
        driver = subprocess.run(namespace.command([sys.executable, "-c", DRIVER, f"127.0.0.1:{gcs_port}",
                                                   str(http_port)]),
                                env=client_env, capture_output=True, text=True, timeout=300)
        assert driver.returncode == 0 and "proxies started" in driver.stdout, driver.stderr[-3000:]
        yield request.param, http_port
    finally:
        namespace.close()
        shutil.rmtree(ray_temp, ignore_errors=True)


def status_and_head(sock) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    return int(data.split()[1]), data


def test_a_proxy_of_a_cluster_started_with_ray_start_answers_431_only_with_the_node_hook(serve_on_started_cluster):
    case, port = serve_on_started_cluster
    with connect(port) as sock:
        sock.sendall(request("GET", "/v1/models", headers={"X-Fill": "a" * (2 * MAX_HEADER_BYTES)}))
        status, body = status_and_head(sock)
    if case == "node env of deploy/aws.yaml":
        assert status == 431, body
        assert b"max_header_bytes" in body
    else:
        assert status == 404, body  # Serve's own proxy read all of it
    print(f"{case}: a {2 * MAX_HEADER_BYTES}-byte header -> {status}")
    with connect(port) as sock:  # a head within the limit is served either way (no app: 404)
        sock.sendall(request("GET", "/v1/models"))
        assert status_and_head(sock)[0] == 404
