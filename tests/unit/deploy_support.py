"""Read the `ray start` commands of the `ray up` configs in deploy/, for the tests that check them."""

import shlex
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def ray_start_commands(config: dict) -> dict[str, str]:
    """The one `ray start` command line of the head and of the workers."""
    [head] = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    [worker] = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    return {"head": head, "worker": worker}


def ray_start_env(command: str) -> dict[str, str]:
    """The VAR=value assignments a `ray start` command line runs with."""
    words = shlex.split(command.replace(";", " ; "))
    start = words.index("ray")
    assert words[start + 1] == "start", command
    env_words = words[words.index(";") + 1:start]
    return dict(word.split("=", 1) for word in env_words)
