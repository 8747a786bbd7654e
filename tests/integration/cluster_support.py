"""The set-up the integration test modules share: a `kvmesh serve` on this machine started from a
serving config written to a YAML file, by default with CPU workers of a tiny random model."""

from __future__ import annotations

from contextlib import contextmanager

import yaml

from kvmesh.cluster.local import LocalCluster

MODEL = "random:tiny-llama"


def cpu_config(num_replicas: int = 1, engine: dict | None = None, replicas: dict | None = None,
               **sections) -> dict:
    """A serving config of `num_replicas` CPU workers (one CPU each) serving MODEL. `engine` and
    `replicas` add to those sections; any other section (server, limits, ...) goes in as given."""
    return {"model": MODEL, "engine": {"device": "cpu", **(engine or {})},
            "replicas": {"num_replicas": num_replicas, "num_gpus": 0, "num_cpus": 1,
                         **(replicas or {})},
            **sections}


@contextmanager
def config_cluster(tmp_path_factory, config: dict, args: list[str] = (), **kwargs):
    """A LocalCluster serving `config`, with `args` added to its command line; kwargs go to
    LocalCluster (start_timeout_s, ray_auth)."""
    path = tmp_path_factory.mktemp("cfg") / "kvmesh.yaml"
    path.write_text(yaml.safe_dump(config))
    with LocalCluster(list(args), config=str(path), **kwargs) as cluster:
        yield cluster
