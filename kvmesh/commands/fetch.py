"""`kvmesh fetch MODEL`: put a model on this machine's disk before serving it (a hub id is
downloaded into the hub's cache, the default model converted once), e.g. in a Kubernetes init
container that fills a shared model volume before Ray starts."""

import json

from kvmesh.commands import add_command


def register(subparsers) -> None:
    p = add_command(subparsers, "fetch", run,
                    help="download or convert a model into the local cache, ready to serve")
    p.add_argument("model", help="hub id, smollm2-135m-instruct, a .gguf file or a model directory")
    p.add_argument("--json", action="store_true", help="print {model, name, path} as JSON")


def run(args) -> int:
    """Fetch MODEL into the local cache: a hub id (org/name[@revision]; HF_ENDPOINT, HF_TOKEN and
    HF_HOME apply), the default model (converted once), a .gguf file or a model directory (checked).
    Prints the directory the engine will load."""
    from kvmesh.worker.loader import load_hf_config, resolve_model

    source = resolve_model(args.model)
    if source.path is None:
        raise ValueError(f"model: {args.model} is a random preset; there is nothing to fetch")
    load_hf_config(source)  # a directory the engine could not read fails here, not in every replica
    if args.json:
        print(json.dumps({"model": args.model, "name": source.name, "path": str(source.path)}))
    else:
        print(source.path)
    return 0
