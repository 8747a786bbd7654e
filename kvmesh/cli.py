"""`kvmesh` command line. Each subcommand lives in its own module with `register(subparsers)`;
the module's handler runs as `args.handler(args)` and returns an exit code."""

import argparse
import importlib
import sys

# name of the module that registers each group of subcommands; imported when the CLI starts, so
# registrars import only argparse-level things (heavy imports go inside the handlers).
REGISTRARS = [
    "kvmesh.commands.generate",  # kvmesh generate
    "kvmesh.commands.serve",  # kvmesh serve, kvmesh client, kvmesh status
    "kvmesh.commands.bench",  # kvmesh bench offline, kvmesh bench latency, kvmesh bench serve
    "kvmesh.commands.sim",  # kvmesh sim
    "kvmesh.commands.fetch",  # kvmesh fetch
]


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh", description="Serve LLMs on a cluster of GPUs with KV-aware routing.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in REGISTRARS:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as e:
        print(f"kvmesh {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
