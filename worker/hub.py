"""Models from the Hugging Face hub: a `model` value such as `Qwen/Qwen3-8B` (or
`Qwen/Qwen3-8B@<branch, tag or commit>`) that is not an existing path is fetched with
`huggingface_hub.snapshot_download` into its cache (HF_HOME; a shared volume on a cluster), once.

The hub's own environment variables apply: HF_ENDPOINT (a mirror or a private hub), HF_TOKEN (gated
or private models), HF_HUB_OFFLINE=1 (use the cache only). Only what kvmesh loads is fetched: the
config, tokenizer and chat-template files and the safetensors weights (not .bin, .pth, GGUF or ONNX
copies that many repositories also hold).
"""

import os
import re
from pathlib import Path

# org/name[@revision]: the hub's repository id rules (letters, digits, '-', '_', '.'), one slash.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w./-]+))?$")
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `model` reads as a hub id and is not a local path."""
    match = HUB_ID.match(model)
    if match is None or Path(model).expanduser().exists():
        return None
    return match["repo"], match["revision"]


def fetch(repo_id: str, revision: str | None = None) -> Path:
    """Download (or find in the cache) a hub model's files; the snapshot directory."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    where = f"{repo_id}@{revision}" if revision else repo_id
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=MODEL_FILES, **_hub_env())
    except GatedRepoError as e:
        raise ValueError(f"model: {where} is gated on the hub; accept its terms and set HF_TOKEN "
                         f"(a Kubernetes Secret: huggingface.tokenSecret): {e}") from e
    except RepositoryNotFoundError as e:
        raise ValueError(f"model: {where} was not found on the hub (or is private: set HF_TOKEN)") from e
    except LocalEntryNotFoundError as e:
        raise ValueError(f"model: cannot reach the hub for {where} and it is not in the cache "
                         f"(HF_ENDPOINT, HF_HUB_OFFLINE): {e}") from e
    except HfHubHTTPError as e:
        raise ValueError(f"model: fetching {where} from the hub failed: {e}") from e
    return Path(path)


def _hub_env() -> dict:
    """The hub's variables as this process has them now. huggingface_hub reads them once, when first
    imported (transformers imports it early), so a value set later would be missed."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    return {"endpoint": os.environ.get("HF_ENDPOINT") or None,
            "token": os.environ.get("HF_TOKEN") or None,
            "cache_dir": os.environ.get("HF_HUB_CACHE") or home / "hub",
            "local_files_only": os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")}
