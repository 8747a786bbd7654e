"""docs/DEPLOY.md and README.md, outside the Helm chart: behaviours they state that no other unit
test would catch if they stopped being true (the images' versions and users, the `ray up` node
types, the defaults the README quotes). Nothing here starts Ray or reaches a network: the Ray a
local `kvmesh serve` starts or joins is checked on a real one in
tests/integration/test_doc_claims_ray_live.py. The Helm chart's claims are in
test_doc_claims_deploy_helm.py."""

import inspect
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # deploy_support, test_images

from deploy_support import load  # noqa: E402
from test_images import DOCKERFILES, instructions  # noqa: E402

from kvmesh import serve_config as serving  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CLOUD_CONFIGS = ["aws.yaml", "gcp.yaml"]


def _args(flavor: str, op: str) -> list[str]:
    return [args for instruction, args in instructions(DOCKERFILES[flavor]) if instruction == op]


def _arg_default(flavor: str, name: str) -> str:
    [value] = [args.split("=", 1)[1] for args in _args(flavor, "ARG") if args.startswith(name + "=")]
    return value


# ---- Images ------------------------------------------------------------------------------------

def test_the_cpu_image_is_python_3_11_with_the_cpu_build_of_torch_2_13_0():
    """DEPLOY.md: "docker/Dockerfile.cpu (Python 3.11, CPU torch 2.13.0 ...)"."""
    assert _arg_default("cpu", "BASE").startswith("python:3.11-")
    assert _arg_default("cpu", "TORCH_VERSION") == "2.13.0"
    assert _arg_default("cpu", "TORCH_INDEX") == "https://download.pytorch.org/whl/cpu"


def test_the_readme_installs_the_torch_the_cpu_image_installs():
    """README: the main command's CPU build of torch (torch==2.13.0), the one the CPU image has."""
    readme = (REPO / "README.md").read_text()
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        command = readme.split(marker, 1)[1].split("```", 2)[1]
        assert f"pip install -q torch=={_arg_default('cpu', 'TORCH_VERSION')} " in command


def test_the_cuda_image_is_ubuntu_24_04_cuda_12_8_torch_2_11_0_and_flashinfer_0_7_2_with_its_kernels():
    """DEPLOY.md: "Ubuntu 24.04, Python 3.12, CUDA 12.8, torch 2.11.0+cu128, flashinfer 0.7.2 with
    flashinfer-cubin and flashinfer-jit-cache, so pods do not compile kernels on first use"."""
    assert re.fullmatch(r"nvidia/cuda:12\.8\.\d+-cudnn-devel-ubuntu24\.04", _arg_default("cuda", "BASE"))
    assert _arg_default("cuda", "TORCH_VERSION") == "2.11.0"
    assert _arg_default("cuda", "TORCH_INDEX") == "https://download.pytorch.org/whl/cu128"
    assert _arg_default("cuda", "FLASHINFER_VERSION") == "0.7.2"
    runs = " ".join(_args("cuda", "RUN"))
    # Ubuntu 24.04's python3 is 3.12: the venv is made from the distribution's, not another.
    assert "apt-get install -y --no-install-recommends python3 python3-venv" in runs
    assert "python3 -m venv /opt/venv" in runs
    for package in ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache"):
        assert f'"{package}==${{FLASHINFER_VERSION}}"' in runs


def test_the_cuda_image_builds_flash_attn_only_when_asked():
    """DEPLOY.md: "flash-attn only with --build-arg FLASH_ATTN=1"."""
    assert _arg_default("cuda", "FLASH_ATTN") == "0"
    runs = " ".join(_args("cuda", "RUN"))
    [install] = re.findall(r"if \[ \"\$\{FLASH_ATTN\}\" = \"1\" \]; then [^;]*pip install [^;]*flash-attn; fi", runs)
    assert runs.count("flash-attn") == 1, install  # no other install of it


@pytest.mark.parametrize("flavor", list(DOCKERFILES))
def test_both_images_run_as_uid_1000_ray_with_the_default_model_in_opt_kvmesh_cache(flavor):
    """DEPLOY.md: "convert the default model into /opt/kvmesh-cache at build time; both run as uid
    1000 `ray`"."""
    runs = " ".join(_args(flavor, "RUN"))
    assert "useradd --create-home --uid 1000 --shell /bin/bash ray" in runs
    assert "KVMESH_CACHE=/opt/kvmesh-cache" in " ".join(_args(flavor, "ENV")).split()
    assert "chown -R ray:ray /opt/kvmesh-cache" in runs
    assert _args(flavor, "USER") == ["ray"]


def test_the_build_context_leaves_out_the_docs():
    """DEPLOY.md: ".dockerignore keeps .git, .venv, tests and docs out of the context"."""
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", "tests", "docs"} <= ignored


# ---- One machine: the Ray a `kvmesh serve` starts or joins ------------------------------------

# A local `kvmesh serve`'s Ray without a dashboard, and `--address` passing the worker hook with the
# config's settings: on a real Ray in tests/integration/test_doc_claims_ray_live.py.


def test_deploy_serve_yaml_asks_for_two_gpu_replicas():
    """DEPLOY.md: "deploy/serve.yaml asks for two GPU replicas"."""
    config = serving.load_config(str(REPO / "deploy" / "serve.yaml"))
    assert (config.replicas.num_replicas, config.replicas.num_gpus) == (2, 1)
    assert config.engine.device != "cpu"


def test_the_local_fake_provider_is_named_by_its_class_as_an_external_provider():
    """DEPLOY.md: "The provider is named by its class (provider.type: external)"."""
    provider = load("local-fake.yaml")["provider"]
    assert provider["type"] == "external"
    assert provider["module"].rsplit(".", 1)[1] == "FakeMultiNodeProvider"


# ---- Cloud VMs with `ray up` -------------------------------------------------------------------

@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_gpu_node_types_are_one_l4_or_eight_h100_per_node_removed_after_10_idle_minutes(name):
    """DEPLOY.md: "(min_workers: 0, max_workers per type, idle_timeout_minutes: 10): one L4 per node
    for small models, eight H100 per node for large ones"."""
    config = load(name)
    assert config["idle_timeout_minutes"] == 10
    gpu_types = {(t["resources"]["GPU"], next(r for r in t["resources"] if r.startswith("accelerator_type:")))
                 for t in config["available_node_types"].values() if t["resources"].get("GPU")}
    assert gpu_types == {(1, "accelerator_type:L4"), (8, "accelerator_type:H100")}


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_a_replica_asking_for_accelerator_type_h100_fits_only_the_h100_node_type(name):
    """DEPLOY.md: "To pin replicas to one GPU type, ask for its resource:
    replicas.resources: {"accelerator_type:H100": 0.001}"."""
    config = serving.parse_config({"replicas": {"resources": {"accelerator_type:H100": 0.001}}})
    assert config.replicas.resources == {"accelerator_type:H100": 0.001}
    offering = [n for n, t in load(name)["available_node_types"].items() if "accelerator_type:H100" in t["resources"]]
    assert len(offering) == 1 and load(name)["available_node_types"][offering[0]]["resources"]["GPU"] == 8


def test_gcp_nodes_run_deep_learning_vm_images():
    """DEPLOY.md: "GCP nodes run the Deep Learning VM images"."""
    for name, node_type in load("gcp.yaml")["available_node_types"].items():
        [disk] = node_type["node_config"]["disks"]
        image = disk["initializeParams"]["sourceImage"]
        assert image.startswith("projects/deeplearning-platform-release/global/images/family/"), name


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_the_heads_kvmesh_serve_runs_in_the_background_logging_to_kvmesh_serve_log(name):
    """DEPLOY.md: "the head runs kvmesh serve deploy/serve.yaml --address auto in the background
    (log: ~/kvmesh-serve.log)"."""
    command = load(name)["head_start_ray_commands"][-1]
    assert command.startswith("cd ~/kvmesh && nohup kvmesh serve deploy/serve.yaml --address auto ")
    assert command.endswith("> ~/kvmesh-serve.log 2>&1 &")


# ---- README: defaults and the Python API it quotes ---------------------------------------------

def test_the_default_model_is_converted_into_kvmesh_cache_or_dot_cache_kvmesh(monkeypatch):
    """README / DEPLOY.md: converted once into `KVMESH_CACHE` (default `~/.cache/kvmesh`)."""
    from kvmesh.worker.loader import cache_dir

    monkeypatch.delenv("KVMESH_CACHE", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "kvmesh"
    monkeypatch.setenv("KVMESH_CACHE", "/opt/kvmesh-cache")
    assert cache_dir() == Path("/opt/kvmesh-cache")
    assert serving.ServeConfig().model == "smollm2-135m-instruct"


README_ENGINE_ARGUMENTS = ["max_num_batched_tokens", "max_num_seqs", "block_size", "kv_cache_memory_bytes",
                           "gpu_memory_utilization", "enable_prefix_caching", "attention_backend", "kv_cache_dtype",
                           "device", "dtype", "max_model_len", "seed", "tensor_parallel_size", "quantization"]


def test_every_engine_argument_the_readme_lists_is_an_llm_keyword_with_the_values_it_names():
    """README: "Engine arguments are LLM keywords: max_num_batched_tokens, ..., quantization";
    attention_backend auto/torch/triton/flashinfer/flash_attn; kv_cache_dtype auto/fp8/fp8_e4m3;
    quantization None (default) or "fp8"."""
    from kvmesh import config as engine_config

    assert set(README_ENGINE_ARGUMENTS) <= set(engine_config.EngineConfig.field_names())
    assert set(engine_config.ATTENTION_BACKENDS) == {"auto", "torch", "triton", "flashinfer", "flash_attn"}
    assert set(engine_config.KV_CACHE_DTYPES) == {"auto", "fp8", "fp8_e4m3"}
    assert set(engine_config.QUANTIZATIONS) == {None, "fp8"}
    assert engine_config.EngineConfig().quantization is None


def test_the_readme_names_every_random_preset_and_no_other():
    """README: "random weights from a preset: random:qwen3-0.6b, random:qwen3-8b, ..."."""
    from kvmesh.worker.presets import PRESETS

    readme = (REPO / "README.md").read_text()
    named = set(re.findall(r"`random:([\w.-]+)`", readme.split("## Layout")[0]))
    assert named == set(PRESETS)


def test_the_large_presets_have_the_shapes_the_readme_gives_them():
    """README: random:qwen3-8b has Qwen3-8B's shape; random:qwen3-moe-a3b-small Qwen3-30B-A3B's
    width and 8 of its 48 layers. The expected values are those models' published config.json."""
    from kvmesh.worker.presets import PRESETS

    qwen3_8b = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    qwen3_30b_a3b = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                         head_dim=128, tie_word_embeddings=False)
    for preset, published in (("qwen3-8b", qwen3_8b), ("qwen3-moe-a3b-small", qwen3_30b_a3b)):
        config = PRESETS[preset]
        assert {k: config.get(k) for k in published} == published, preset
    assert PRESETS["qwen3-moe-a3b-small"]["num_hidden_layers"] == 8


def test_grpc_stream_takes_the_arguments_the_readme_passes():
    """README: grpc_stream("127.0.0.1:9000", "What is ...?", max_tokens=32, temperature=0)."""
    from kvmesh.cluster.client import grpc_stream

    inspect.signature(grpc_stream).bind("127.0.0.1:9000", "What is the capital of France?", max_tokens=32,
                                        temperature=0)


def test_the_served_config_and_the_local_default_differ_only_where_the_docs_say():
    """README: a bare `kvmesh serve` listens on 127.0.0.1:8000 (HTTP) and 127.0.0.1:9000 (gRPC),
    reflection off; DEPLOY.md: deploy/serve.yaml listens on every interface for `ray attach -p`."""
    server = serving.ServeConfig().server
    assert (server.host, server.http_port, server.grpc_port, server.grpc_reflection) == ("127.0.0.1", 8000, 9000, False)
    served = serving.load_config(str(REPO / "deploy" / "serve.yaml")).server
    assert (served.http_port, served.grpc_port, served.direct_http_port) == (8000, 9000, 0)


def test_grpc_reflection_is_served_only_when_server_grpc_reflection_is_true():
    """README: "server reflection is off unless server.grpc_reflection: true"."""
    from kvmesh.cluster.app import serve_config_document

    def reflection(**server):
        return serve_config_document(serving.parse_config({"server": server}))["grpc_options"]["enable_reflection"]

    assert (reflection(), reflection(grpc_reflection=True)) == (False, True)


def test_kvmesh_status_and_llm_default_to_the_local_server_and_the_default_model():
    """README: `kvmesh status` (no --url) reads the local server; `LLM()` is SmolLM2-135M-Instruct."""
    from kvmesh.cli import build_parser
    from kvmesh.config import EngineConfig

    assert build_parser().parse_args(["status"]).url == "http://127.0.0.1:8000"
    assert EngineConfig().model == "smollm2-135m-instruct"
