"""The README's `shardwise` command lines use only commands and options that exist.

For every `shardwise <command> [<subcommand>] ...` the README shows in its console blocks (read with
`shardwise.e2e.readme.console_commands`, the extractor the quick-start and kind suites replay), this
runs `shardwise <command> [<subcommand>] --help` in a subprocess and asserts that it exits 0 and
that every long (`--foo`) and short (`-x`) option the README passes appears in that help. The
README's CLI table (`## The CLI`), where the usage of each command is summarised in one cell, is
checked the same way. So a renamed or removed flag fails here, naming the command, instead of
reaching a reader. No cluster, Docker or model is needed; each `--help` takes a fraction of a second.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli import COMMANDS
from shardwise.e2e.readme import console_commands

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

OPTION = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*|-[A-Za-z])(?![\w-])")
SHELL_PUNCTUATION = set("();<>|&")


# ---------------------------------------------------------------- the README's commands

def console_blocks_commands(text: str) -> list[str]:
    """The `$ ` commands of every console block of the README, section by section and block by
    block, each block read by console_commands (which reads the first block of one section)."""
    commands: list[str] = []
    for section in re.split(r"^(?=## )", text, flags=re.M):
        body = section.partition("\n")[2] if section.startswith("## ") else section
        while True:
            try:
                commands += console_commands(f"## S\n{body}", "S")
            except ValueError:       # no console block left in this section
                break
            body, removed = re.subn(r"^```console\n.*?^```", "", body, count=1, flags=re.S | re.M)
            assert removed, "console_commands found a block that is not there"
    return commands


def invocations(command: str) -> list[list[str]]:
    """The `shardwise ...` simple commands inside one shell command line, as words: through `&&`,
    `;`, pipes, `VAR=value` prefixes, `eval` and `$( ... )`."""
    lexer = shlex.shlex(command.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    found: list[list[str]] = []
    simple: list[str] = []
    for token in [*lexer, ";"]:
        if "$(" in token:                           # "$(shardwise kind env)" quoted: one token
            inner = token[token.index("$(") + 2:token.rindex(")")] if ")" in token else token
            found += invocations(inner)
        if set(token) <= SHELL_PUNCTUATION:
            words = [w for w in simple if w not in ("$",)]
            while words and (re.match(r"^[A-Za-z_]\w*=", words[0]) or words[0] in ("eval", "exec", "time")):
                words = words[1:]
            if words and words[0] == "shardwise":
                found.append(words)
            simple = []
        else:
            simple.append(token)
    return found


def options_of(words: list[str]) -> list[str]:
    """The options a command line passes (`--foo=1` as `--foo`; `-t3` as `-t`)."""
    out = []
    for word in words:
        if word == "--":
            break
        if word.startswith("--") and len(word) > 2:
            out.append(word.split("=", 1)[0])
        elif re.match(r"^-[A-Za-z]", word):
            out.append(word[:2])
    return out


@functools.cache
def subcommands(command: str) -> tuple[str, ...]:
    """The subcommands of `shardwise <command>` (dev up, crds check...), from its argument parser."""
    module = importlib.import_module(COMMANDS[command][0])
    parser = argparse.ArgumentParser(prog=f"shardwise {command}")
    module.add_arguments(parser)
    for action in parser._actions:                  # noqa: SLF001 - argparse keeps them here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return tuple(action.choices)
    return ()


def split_command(words: list[str]) -> list[tuple[tuple[str, ...], list[str]]]:
    """[(help path, options given to it)]: options before a subcommand belong to the command's own
    parser (`shardwise dev --state-dir D up`), those after it to the subcommand's."""
    command = words[1]
    if command not in COMMANDS:
        return [((command,), [])]
    subs = subcommands(command)
    rest = words[2:]
    at = next((i for i, w in enumerate(rest) if w in subs), None)
    if at is None:
        return [((command,), options_of(rest))]
    head = options_of(rest[:at])
    return ([((command,), head)] if head else []) + [((command, rest[at]), options_of(rest[at + 1:]))]


def readme_uses() -> dict[tuple[str, ...], dict[str, str]]:
    """(command[, subcommand]) -> {option: the README line that uses it}, from the console blocks."""
    uses: dict[tuple[str, ...], dict[str, str]] = {}
    for command in console_blocks_commands(README.read_text()):
        for words in invocations(command):
            if len(words) < 2:
                continue
            for path, options in split_command(words):
                seen = uses.setdefault(path, {})
                for option in options:
                    seen.setdefault(option, " ".join(words))
    return uses


def table_uses() -> dict[tuple[str, ...], dict[str, str]]:
    """The same from the first column of the README's CLI table: `shardwise dev build\\|up\\|...`
    names each subcommand; options are every `--foo`/`-x` in the cell."""
    section = re.search(r"^## The CLI\b.*?(?=^## |\Z)", README.read_text(), re.S | re.M)
    assert section, "README.md has no '## The CLI' section"
    uses: dict[tuple[str, ...], dict[str, str]] = {}
    for cell in re.findall(r"^\| `(shardwise [^`]+)` \|", section.group(0), re.M):
        usage = cell.replace("\\|", "|")
        words = usage.split()
        command = words[1]
        subs = subcommands(command) if command in COMMANDS else ()
        second = words[2].split("|") if len(words) > 2 else []
        if second and all(s in subs for s in second):      # `dev build|up|...`, `operator run`
            paths, rest = [(command, s) for s in second], " ".join(words[3:])
        else:
            paths, rest = [(command,)], " ".join(words[2:])
        for path in paths:
            seen = uses.setdefault(path, {})
            for option in OPTION.findall(rest):
                seen.setdefault(option, usage)
    return uses


# ---------------------------------------------------------------- --help

@functools.cache
def help_of(path: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONSAFEPATH="1")   # the repo's operator/ must not shadow the stdlib's
    return subprocess.run([sys.executable, "-m", "shardwise", *path, "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def check(path: tuple[str, ...], options: dict[str, str], where: str) -> None:
    name = "shardwise " + " ".join(path)
    assert path[0] in COMMANDS, f"{where} uses `{name}`, but shardwise has no command {path[0]!r}"
    result = help_of(path)
    assert result.returncode == 0, (f"`{name} --help` exited {result.returncode}:\n"
                                    f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
    missing = {o: line for o, line in options.items()
               if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", result.stdout)}
    assert not missing, (f"{where} passes option(s) that `{name} --help` does not list: "
                         + "; ".join(f"{o} (in `{line}`)" for o, line in missing.items())
                         + f"\n\n{result.stdout}")


README_USES = readme_uses()
TABLE_USES = table_uses()


def _ids(uses: dict) -> list[str]:
    return ["/".join(path) for path in uses]     # `kind/docker`: `shardwise kind docker`


@pytest.mark.parametrize("path", list(README_USES), ids=_ids(README_USES))
def test_readme_console_command_options_exist(path):
    check(path, README_USES[path], "a README console block")


@pytest.mark.parametrize("path", list(TABLE_USES), ids=_ids(TABLE_USES))
def test_readme_cli_table_options_exist(path):
    check(path, TABLE_USES[path], "the README's CLI table")


def test_the_readme_commands_are_found():
    """The extraction itself: a sample, and the README's own commands (so an empty parametrization
    cannot pass silently)."""
    sample = ("## A\n```console\n$ SHARDWISE_X=1 shardwise serve --model m -t 2 \\\n    --port 0 && "
              "eval \"$(shardwise dev env)\"\nout\n```\ntext\n```console\n$ shardwise dev --state-dir d up "
              "--nodes 2; echo shardwise -x\n```\n## B\n```console\n$ kubectl get sm\n```\n")
    commands = console_blocks_commands(sample)
    assert commands == ["SHARDWISE_X=1 shardwise serve --model m -t 2 \\\n    --port 0 && "
                        "eval \"$(shardwise dev env)\"",
                        "shardwise dev --state-dir d up --nodes 2; echo shardwise -x", "kubectl get sm"]
    words = [w for c in commands for w in invocations(c)]
    assert words == [["shardwise", "serve", "--model", "m", "-t", "2", "--port", "0"],
                     ["shardwise", "dev", "env"], ["shardwise", "dev", "--state-dir", "d", "up", "--nodes", "2"]]
    assert split_command(words[2]) == [(("dev",), ["--state-dir"]), (("dev", "up"), ["--nodes"])]
    assert options_of(words[0]) == ["--model", "-t", "--port"]
    assert {"demo", "generate", "kind/build"} <= set(_ids(README_USES)), _ids(README_USES)
    assert {"train", "worker", "operator/run", "dev/up", "crds/check"} <= set(_ids(TABLE_USES)), _ids(TABLE_USES)


def test_every_readme_shell_block_with_shardwise_is_a_console_block():
    """Commands are read from ```console blocks (`$ ` lines); one in a bash/sh block would escape."""
    text = README.read_text()
    for lang, body in re.findall(r"^```(bash|sh|shell|zsh)\n(.*?)^```", text, re.S | re.M):
        assert "shardwise" not in body, (f"a ```{lang} block of README.md runs shardwise; write it as a "
                                         f"```console block with `$ ` lines so its options are checked:\n{body}")
