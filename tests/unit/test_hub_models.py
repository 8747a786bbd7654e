"""A model given as a hub id (org/name[@revision]) is fetched with huggingface_hub from HF_ENDPOINT
(here a loopback server speaking the hub's file API, tests/unit/fake_hub.py), with HF_TOKEN for gated
repositories, into HF_HOME once; only the files kvmesh loads are fetched; it is served under its hub
id and generates what the same weights generate from a local directory."""

import json
from pathlib import Path

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.cli import main
from kvmesh.worker.hub import parse_hub_id
from kvmesh.worker.loader import resolve_model
from tests.unit.fake_hub import FakeHub
from tests.unit.test_models_loading import save_hf_dir


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_hf_dir(folder, "tiny-llama")
    return folder


@pytest.fixture()
def hub(tiny_model, tmp_path, monkeypatch):
    with FakeHub() as hub:
        hub.add_repo("acme/tiny-llama", tiny_model,
                     extra={"pytorch_model.bin": b"\0" * 1000, "README.md": b"# tiny", "model.gguf": b"GGUF"})
        hub.add_repo("acme/gated-llama", tiny_model, token="hf_secret")
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        yield hub  # set after huggingface_hub was imported: kvmesh reads them at fetch time


def test_hub_ids_are_told_from_paths_and_names(tmp_path):
    assert parse_hub_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert parse_hub_id("meta-llama/Llama-3.1-8B-Instruct@v1.0") == ("meta-llama/Llama-3.1-8B-Instruct", "v1.0")
    for not_hub in ("smollm2-135m-instruct", "/models/Qwen3-8B", "./a/b", "a/b/c", "random:tiny-llama", "a b/c"):
        assert parse_hub_id(not_hub) is None, not_hub
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_hub_id(str(tmp_path / "org" / "name")) is None  # an existing directory is a path


def test_a_hub_model_is_fetched_once_with_only_the_files_kvmesh_loads(hub, tiny_model):
    source = resolve_model("acme/tiny-llama")
    assert source.name == "acme/tiny-llama"
    assert (source.path / "config.json").is_file() and (source.path / "model.safetensors").is_file()
    fetched = sorted(hub.downloads())
    assert "pytorch_model.bin" not in fetched and "README.md" not in fetched and "model.gguf" not in fetched
    assert "model.safetensors" in fetched and "config.json" in fetched and "tokenizer.json" in fetched
    assert (source.path / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    before = len(hub.downloads())
    assert resolve_model("acme/tiny-llama").path == source.path
    assert len(hub.downloads()) == before  # the second resolve fetches no file again


def test_a_hub_model_generates_what_the_local_directory_generates(hub, tiny_model):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = [5, 17, 42, 9]
    from_hub = LLM(model="acme/tiny-llama", device="cpu").generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    local = LLM(model=str(tiny_model), device="cpu").generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert from_hub.token_ids == local.token_ids


def test_a_gated_model_needs_the_token(hub, monkeypatch):
    with pytest.raises(ValueError, match="acme/gated-llama is gated on the hub.*HF_TOKEN"):
        resolve_model("acme/gated-llama")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert resolve_model("acme/gated-llama").name == "acme/gated-llama"
    assert ("GET", "/api/models/acme/gated-llama/revision/main", "Bearer hf_secret") in hub.requests


def test_an_unknown_repository_and_an_offline_cache_miss_say_what_to_do(hub, monkeypatch):
    with pytest.raises(ValueError, match="acme/nothing was not found on the hub"):
        resolve_model("acme/nothing")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="not in the cache"):
        resolve_model("acme/tiny-llama")


def test_a_revision_after_the_at_sign_fetches_that_branch_s_files(hub, tiny_model, tmp_path):
    """DEPLOY.md: `org/name@revision` (a branch, tag or commit) fetches that revision, not main."""
    other = tmp_path / "v2"
    save_hf_dir(other, "tiny-llama", seed=11)
    sha = hub.add_revision("acme/tiny-llama", "v2", other)
    main_source, v2 = resolve_model("acme/tiny-llama"), resolve_model("acme/tiny-llama@v2")
    assert v2.name == "acme/tiny-llama" and v2.path.name == sha  # the snapshot of v2's commit
    weights = (v2.path / "model.safetensors").read_bytes()
    assert weights == (other / "model.safetensors").read_bytes()
    assert weights != (main_source.path / "model.safetensors").read_bytes()
    assert any(path == "/api/models/acme/tiny-llama/revision/v2" for _, path, _ in hub.requests)
    with pytest.raises(ValueError, match="acme/tiny-llama@v3"):
        resolve_model("acme/tiny-llama@v3")


def test_a_cached_model_loads_under_hf_hub_offline_without_asking_the_hub(hub, tiny_model, monkeypatch):
    """DEPLOY.md: HF_HUB_OFFLINE=1 applies: a model fetched once loads from the cache alone."""
    fetched = resolve_model("acme/tiny-llama")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    asked = len(hub.requests)
    offline = resolve_model("acme/tiny-llama")
    assert offline.path == fetched.path
    params = SamplingParams(max_tokens=8, temperature=0.0)
    out = LLM(model="acme/tiny-llama", device="cpu").generate(prompt_token_ids=[[5, 17, 42, 9]],
                                                               sampling_params=params, use_tqdm=False)[0]
    assert len(hub.requests) == asked, hub.requests[asked:]  # not one request reached the hub
    local = LLM(model=str(tiny_model), device="cpu").generate(prompt_token_ids=[[5, 17, 42, 9]],
                                                              sampling_params=params, use_tqdm=False)[0]
    assert out.token_ids == local.token_ids


def test_kvmesh_fetch_prints_the_directory_to_serve(hub, tmp_path, capsys):
    assert main(["fetch", "acme/tiny-llama", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["name"] == "acme/tiny-llama"
    assert (Path(report["path"]) / "model.safetensors").is_file()
    assert Path(report["path"]).is_relative_to(tmp_path / "hf-home")
    assert main(["fetch", "acme/nothing"]) == 2
    assert "kvmesh fetch: error: model: acme/nothing was not found on the hub" in capsys.readouterr().err


def test_a_converted_gguf_is_found_again_after_its_file_is_copied_or_touched(tmp_path, monkeypatch):
    """The conversion is keyed by the file's content: an image layer (or a copy to another node's
    disk) keeps the bytes but not the path or the mtime, and must not convert again. It is written
    under $KVMESH_CACHE (README: "dequantized once into ~/.cache/kvmesh or $KVMESH_CACHE")."""
    import os
    import shutil

    from kvmesh.worker.loader import default_gguf_path

    monkeypatch.setenv("KVMESH_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for copy in (first, second):
        copy.parent.mkdir()
        shutil.copyfile(default_gguf_path(), copy)
    converted = resolve_model(str(first)).path
    assert converted.parent == tmp_path / "cache" / "models" and (converted / "config.json").is_file()
    os.utime(second, (1_000_000, 1_000_000))
    assert resolve_model(str(second)).path == converted
