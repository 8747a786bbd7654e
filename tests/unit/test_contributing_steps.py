"""docs/CONTRIBUTING.md's steps, where no other test holds them: the lists of policy, backend and
preset names outside the registries (docs, comments, config descriptions) name every registered
one, and every path and name the guide cites exists (in the file it names, where it names one).
tests/unit/test_registries.py holds the lists that code reads (configs, Helm schema, CLIs)."""

import re
from pathlib import Path

import pytest

import kvmesh.router
from kvmesh.router.policies import POLICY_NAMES
from kvmesh.serve_config import EngineSection
from kvmesh.worker.attention.registry import BACKENDS
from kvmesh.worker.presets import PRESETS

REPO = Path(__file__).resolve().parents[2]
GUIDE = " ".join((REPO / "docs/CONTRIBUTING.md").read_text().split())  # inline code may wrap
FP8_BACKENDS = [n for n, s in BACKENDS.items() if "fp8_e4m3" in s.kv_cache_dtypes]


def missing(names, text: str) -> list[str]:
    """The names that `text` lacks as whole words (`torch` is not in `torch_copy`)."""
    return [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]


def yaml_comment(path: str, keys: tuple[str, ...]) -> str:
    """The comment of a nested key in a commented YAML file: the `#` lines right above it and the
    one after it on its line."""
    lines = (REPO / path).read_text().splitlines()
    depth, indent = 0, -1
    for i, line in enumerate(lines):
        text = line.lstrip()
        if not text or text.startswith("#"):
            continue
        level = len(line) - len(text)
        if level <= indent:
            break  # left the parent block
        if level > indent and text.startswith(keys[depth] + ":"):
            if depth == len(keys) - 1:
                above = []
                for prev in reversed(lines[:i]):
                    if not prev.lstrip().startswith("#"):
                        break
                    above.insert(0, prev)
                return "\n".join(above + [text.partition("#")[2]])
            depth, indent = depth + 1, level
    raise AssertionError(f"{path}: no key {'.'.join(keys)}")


# ---- the lists the guide's steps name ----------------------------------------------------------

def test_routing_doc_has_a_row_per_policy():
    section = (REPO / "docs/ROUTING.md").read_text().split("\n## Policies\n")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)`", section, re.M)
    assert sorted(rows) == sorted(POLICY_NAMES), f"docs/ROUTING.md's policy table has {rows}, the registry {POLICY_NAMES}"


@pytest.mark.parametrize("path,keys,names", [
    ("helm/kvmesh/values.yaml", ("kvmesh", "routing", "policy"), POLICY_NAMES),
    ("deploy/serve.yaml", ("routing", "policy"), POLICY_NAMES),
    ("helm/kvmesh/values.yaml", ("kvmesh", "engine", "attention_backend"), ["auto", *BACKENDS]),
    ("deploy/serve.yaml", ("engine", "attention_backend"), ["auto", *BACKENDS]),
])
def test_config_comments_name_every_registered_name(path, keys, names):
    comment = yaml_comment(path, keys)
    assert not missing(names, comment), f"{path} {'.'.join(keys)}: {comment!r} lacks {missing(names, comment)}"


def test_engine_config_descriptions_name_every_backend():
    fields = EngineSection.model_fields
    lacks = missing(["auto", *BACKENDS], fields["attention_backend"].description)
    assert not lacks, f"kvmesh/serve_config.py: EngineSection.attention_backend's description lacks {lacks}"
    lacks = missing(FP8_BACKENDS, fields["kv_cache_dtype"].description)
    assert FP8_BACKENDS and not lacks, f"kvmesh/serve_config.py: EngineSection.kv_cache_dtype's description lacks {lacks}"


def test_router_docstring_lists_the_policy_names():
    listed = re.search(r"names in `POLICY_NAMES`:(.*?)\.", kvmesh.router.__doc__, re.S).group(1)
    assert not missing(POLICY_NAMES, listed), f"router/__init__.py's docstring lacks {missing(POLICY_NAMES, listed)}"


def test_readme_names_every_preset():
    readme = (REPO / "README.md").read_text()
    models = readme[readme.index("\nModels: "):].split("\n\n")[0]
    lacks = missing([f"random:{p}" for p in PRESETS], models)
    assert not lacks, f"README.md's Models paragraph lacks {lacks}"


def test_every_tiny_preset_and_so_every_architecture_is_checked_against_transformers():
    """CONTRIBUTING.md step 3: a new architecture's tiny preset goes into the list of
    test_random_presets_match_transformers; every registered architecture has one."""
    from kvmesh.worker.models import MODELS
    from tests.unit.test_engine_vs_transformers import TRANSFORMERS_PRESETS

    tiny = {name for name in PRESETS if name.startswith("tiny-")}
    assert set(TRANSFORMERS_PRESETS) == tiny
    assert {PRESETS[name]["architectures"][0] for name in tiny} == set(MODELS)


def test_a_missing_name_is_caught():
    """The checks themselves: a name written inside a longer one does not count."""
    assert missing(["torch", "kv_events"], "auto | torch_copy | kv_events") == ["torch"]
    assert missing(["random:tiny-qwen3"], "`random:tiny-qwen3-moe`") == ["random:tiny-qwen3"]
    assert "kv_events" in yaml_comment("deploy/serve.yaml", ("routing", "policy"))
    assert cited_name("make_policy(name, **options)") == "make_policy"
    assert cited_name("cols = columns_of(workers)") is None and cited_name("router/workers.py") is None
    assert NAME_IN_PATH.findall("`POLICY_NAMES` line of the docstring in `router/__init__.py`") == [
        ("POLICY_NAMES", " line of the docstring", "router/__init__.py")]
    assert not words_in("no_such_name", CORPUS)


# ---- what the guide cites exists ---------------------------------------------------------------

INLINE = re.findall(r"`([^`]+)`", GUIDE)
REPO_FOLDERS = ("bench/", "docs/", "tests/", "kvmesh/", "router/", "cluster/", "worker/", "kernels/",
                "deploy/", "helm/")
SOURCES = [p for folder in REPO_FOLDERS[2:] for p in (REPO / folder).rglob("*")
           if p.suffix in (".py", ".json", ".yaml") and "__pycache__" not in p.parts
           and p.name != Path(__file__).name]  # a name only this test spells does not count
CORPUS = "\n".join(p.read_text(errors="replace") for p in SOURCES)
IDENT = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def cited_name(code: str) -> str | None:
    """`make_policy(name, **options)` -> make_policy; `RoutingSection.policy` -> itself; None for
    anything else (paths, commands, assignments, placeholders)."""
    match = IDENT.match(code)
    if match is None or "<" in code or "/" in code or re.fullmatch(r"\w+\.py", code):
        return None
    rest = code[match.end():]
    return match.group() if rest == "" or rest.startswith("(") else None


def by_name(file_name: str) -> list[Path]:
    return [p for p in SOURCES if p.name == file_name]


def words_in(name: str, text: str) -> bool:
    return all(re.search(rf"\b{re.escape(part)}\b", text) for part in name.split("."))


@pytest.mark.parametrize("path", sorted({w.rstrip("/") for c in INLINE for w in c.split()
                                         if w.startswith(REPO_FOLDERS) and "<" not in w}))
def test_cited_path_exists(path):
    assert (REPO / path).exists(), f"docs/CONTRIBUTING.md cites {path}, which is not in the tree"


@pytest.mark.parametrize("name", sorted({c for c in INLINE if re.fullmatch(r"\w+\.py", c)}))
def test_cited_module_file_exists(name):
    assert by_name(name), f"docs/CONTRIBUTING.md cites {name}, which is not in the tree"


# "`NAME` in `PATH`", "`NAME` (`PATH`)", "`NAME` line of the docstring in `PATH`"
NAME_IN_PATH = re.compile(r"`([^`]+)`((?: [a-z]+){0,4}) (?:in |\()`([\w./]+\.\w+)`")


@pytest.mark.parametrize("name,path", sorted({(cited_name(n), p) for n, _, p in NAME_IN_PATH.findall(GUIDE)
                                              if cited_name(n)}))
def test_cited_name_is_in_the_file_the_guide_names(name, path):
    files = [REPO / path] if "/" in path else by_name(path)  # `qwen2.py`: found by name
    assert files and any(words_in(name, f.read_text()) for f in files), \
        f"docs/CONTRIBUTING.md: no {name} in {path}"


@pytest.mark.parametrize("name", sorted({n for c in INLINE if (n := cited_name(c))}))
def test_cited_name_exists(name):
    assert words_in(name, CORPUS), f"docs/CONTRIBUTING.md cites {name}, which no source file has"
