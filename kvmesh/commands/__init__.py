"""The `kvmesh` subcommands, a module each with `register(subparsers)` (kvmesh/cli.py lists them)."""

import argparse
import inspect


def add_command(subparsers, name: str, handler, help: str, description: str | None = None
                ) -> argparse.ArgumentParser:
    """The parser of subcommand `name`, run as `handler(args)`. Its --help description is
    `description`, else the handler's docstring: what a command does is said once, where it is done."""
    parser = subparsers.add_parser(name, help=help, description=description or inspect.getdoc(handler))
    parser.set_defaults(handler=handler)
    return parser
