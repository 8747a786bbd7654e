"""What the README and docs/PERF.md, ROUTING.md, DEPLOY.md, RELIABILITY.md and SERVING.md cite
still exists. Every command in a code block: a `kvmesh ...` line (or `python -m kvmesh.cli` /
`python -m kvmesh.bench.serve`, the same parser) parses with the CLI's own argparse parser and its
policy names are known, and the `kvmesh serve ARGS` a `--launch ARGS` stands for parses too; any
other `python -m kvmesh.X` names a module that exists. A usage line (`kvmesh generate PROMPT
[--model M]`) is not a command: its subcommand parses and its bracketed flags are that
subcommand's. Every repository path in inline code exists, and a raw result named alone is in
bench/results/. Nothing is run."""

import argparse
import contextlib
import glob
import importlib.util
import io
import pathlib
import re
import shlex

import pytest

from kvmesh.cli import build_parser
from kvmesh.router.policies import parse_policy_names

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ("docs/PERF.md", "docs/ROUTING.md", "README.md", "docs/DEPLOY.md", "docs/RELIABILITY.md",
        "docs/SERVING.md")
FENCED_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SHELL_SEPARATORS = {"&&", "||", ";", "|", "&"}
# `python -m MODULE` lines whose arguments the kvmesh parser takes, with the subcommand they stand for
CLI_MODULES = {"kvmesh.cli": [], "kvmesh.bench.serve": ["bench", "serve"]}
INLINE_CODE = re.compile(r"`([^`\n]+)`")
REPO_FOLDERS = ("bench/", "docs/", "tests/", "kvmesh/", "router/", "cluster/", "worker/", "kernels/",
                "deploy/", "helm/")
RAW_RESULT = re.compile(r"(call\d|serve_|sim_)[\w.{},*-]*\.(json|txt)")
# `kvmesh generate PROMPT [--model M] [--chat|--no-chat]`: a usage line, not a shell command
SYNOPSIS = re.compile(r"\s\[-")
FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


def shell_commands(block: str):
    """The simple commands of a shell block: continuation lines joined, comments dropped, split at
    `&&`, `;`, `|`, `&`, leading VAR=value assignments removed."""
    for line in block.replace("\\\n", " ").splitlines():
        if "kvmesh" not in line:  # heredoc bodies (YAML) and other tools' lines
            continue
        if SYNOPSIS.search(line):  # a usage line (doc_synopses)
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command = []
        for token in list(lexer) + [";"]:
            if token in SHELL_SEPARATORS:
                while command and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", command[0]):
                    command.pop(0)
                if command:
                    yield command
                command = []
            else:
                command.append(token)


def doc_commands():
    for doc in DOCS:
        for block in FENCED_BLOCK.findall((ROOT / doc).read_text()):
            for command in shell_commands(block):
                if command[0] == "kvmesh" or (command[0].startswith("python") and command[1:2] == ["-m"]
                                              and command[2].startswith("kvmesh")):
                    yield doc, command


COMMANDS = list(doc_commands())


def doc_synopses():
    for doc in DOCS:
        for block in FENCED_BLOCK.findall((ROOT / doc).read_text()):
            for line in block.splitlines():
                if line.startswith("kvmesh ") and SYNOPSIS.search(line):
                    yield doc, line


SYNOPSES = list(doc_synopses())


def cli_argv(command: list[str]) -> list[str] | None:
    """The argv the kvmesh parser would get, or None for a `python -m` module of its own."""
    if command[0] == "kvmesh":
        return command[1:]
    module = command[2]
    return CLI_MODULES[module] + command[3:] if module in CLI_MODULES else None


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag of the parser and its subcommands' parsers. argparse accepts a unique prefix of a
    flag, so a doc's flag must also be one of these exactly (a renamed flag could leave the old
    spelling a prefix of another)."""
    flags = set()
    for action in parser._actions:  # argparse exposes no public walk over its actions
        flags.update(action.option_strings)
        for sub in (action.choices or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
            flags |= option_strings(sub)
    return flags


FLAGS = option_strings(build_parser())


@pytest.mark.parametrize("doc", DOCS)
def test_each_reference_doc_quotes_kvmesh_commands(doc):
    assert sum(1 for d, command in COMMANDS if d == doc and cli_argv(command) is not None) >= 3


def check_command(doc: str, argv: list[str]) -> None:
    """`kvmesh ARGV` parses, with every flag spelled out and every policy name known; a
    `--launch ARGS` (bench serve, bench soak: they start `kvmesh serve ARGS`) is checked the same."""
    shown = "kvmesh " + shlex.join(argv)
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:
            assert exit_.code == 0, f"{doc}: `{shown}` does not parse: {errors.getvalue()}"
            return
    # a token with a space before any `=` is a quoted value (--launch "--replicas 2"), never a flag:
    # argparse's rule
    flags = [t.split("=")[0] for t in argv if t.startswith("--")]
    unknown = [flag for flag in flags if " " not in flag and flag not in FLAGS]
    assert not unknown, f"{doc}: `{shown}` abbreviates or misspells {unknown}"
    for names in (getattr(args, "policy", None), getattr(args, "policies", None)):
        if names:
            parse_policy_names(names)  # raises ValueError naming an unknown policy
    if getattr(args, "launch", None):
        check_command(doc, ["serve", *shlex.split(args.launch)])


@pytest.mark.parametrize("doc,command", COMMANDS, ids=[" ".join(c)[:90] for _, c in COMMANDS])
def test_doc_command_exists(doc, command):
    argv = cli_argv(command)
    if argv is None:
        assert importlib.util.find_spec(command[2]) is not None, f"{doc}: no module {command[2]}"
        return
    check_command(doc, argv)


def synopsis_parts(line: str) -> tuple[list[str], list[str]]:
    """`kvmesh generate "P" [--model M] [--chat|--no-chat]` -> the argv before the first bracket
    (["generate", "P"]) and the flags in brackets (["--model", "--chat", "--no-chat"])."""
    head, _, optional = line.partition(" [")
    return shlex.split(head)[1:], FLAG.findall("[" + optional)


def subcommand_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the (nested) subcommand that argv's leading words name."""
    parser = build_parser()
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return parser


@pytest.mark.parametrize("doc,line", SYNOPSES, ids=[line[:90] for _, line in SYNOPSES])
def test_doc_usage_line_names_its_subcommands_flags(doc, line):
    argv, flags = synopsis_parts(line)
    check_command(doc, argv)
    own = option_strings(subcommand_parser(argv))
    assert flags and not set(flags) - own, f"{doc}: `{line}` names flags {sorted(set(flags) - own)} " \
                                           f"that `kvmesh {' '.join(argv[:1])}` lacks"


def test_a_missing_flag_or_subcommand_is_caught():
    """The check itself: a doc line with a flag or subcommand the CLI lacks would fail."""
    block = "kvmesh sim --workers 2 --no-such-flag\nFOO=1 kvmesh bench nosuch --json && kvmesh sim --seed 1\n"
    commands = list(shell_commands(block))
    assert commands == [["kvmesh", "sim", "--workers", "2", "--no-such-flag"],
                        ["kvmesh", "bench", "nosuch", "--json"], ["kvmesh", "sim", "--seed", "1"]]
    for bad in commands[:2]:
        with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(cli_argv(bad))
        assert exit_.value.code == 2
    assert "--kv-blocks" in FLAGS and "--kv-block" not in FLAGS  # a prefix argparse would accept
    # what --launch stands for is checked as `kvmesh serve ARGS`
    check_command("doc", ["bench", "soak", "--launch", "--replicas 2 --device cpu", "--duration-s", "1"])
    with pytest.raises(AssertionError, match="no-such-flag"):
        check_command("doc", ["bench", "soak", "--launch", "--replicas 2 --no-such-flag"])
    with pytest.raises(AssertionError, match=r"\['--replica'\]"):  # an abbreviation argparse accepts
        check_command("doc", ["bench", "serve", "--launch=--replica 2"])
    with pytest.raises(AssertionError, match=r"\['--launc'\]"):
        check_command("doc", ["bench", "serve", "--launc=--replicas 2"])
    # a usage line is not split into commands at its `|`; its flags must be the subcommand's
    usage = 'kvmesh generate "a prompt" [--model M] [--chat|--no-chat]'
    assert list(shell_commands(usage + "\n")) == []
    assert synopsis_parts(usage) == (["generate", "a prompt"], ["--model", "--chat", "--no-chat"])
    assert "--chat" in option_strings(subcommand_parser(["generate", "x"]))
    assert "--launch" not in option_strings(subcommand_parser(["generate", "x"]))
    with pytest.raises(ValueError, match="no_such_policy"):
        parse_policy_names("kv_events,no_such_policy")


def expand_braces(pattern: str) -> list[str]:
    """`a_{1,2}.json` -> [`a_1.json`, `a_2.json`] (one brace group, as the docs write them)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [pattern[:match.start()] + part + pattern[match.end():] for part in match.group(1).split(",")]


def cited_paths():
    for doc in DOCS:
        for code in INLINE_CODE.findall((ROOT / doc).read_text()):
            if RAW_RESULT.fullmatch(code):
                yield doc, "bench/results/" + code
            for word in code.split():  # also the script of `bash bench/x.sh`
                if word.startswith(REPO_FOLDERS) and "<" not in word:  # not kvmesh/kvmesh:<tag>
                    yield doc, word.rstrip("/")


PATHS = sorted(set(cited_paths()))


@pytest.mark.parametrize("doc,path", PATHS, ids=[p for _, p in PATHS])
def test_cited_path_exists(doc, path):
    for pattern in expand_braces(path):
        assert glob.glob(str(ROOT / pattern)), f"{doc} cites {pattern}, which is not in the tree"
