"""Every command's --help prints its help and exits 0: argparse formats each option's help text with ``%``, so a
literal percent sign in one (written ``%%``) breaks that command's whole --help with a traceback."""

from __future__ import annotations

import argparse

import pytest

from ddp_triton.cli import build_parser, main


def _commands(parser: argparse.ArgumentParser, prefix=()):
    """Every command path of the CLI: (), ("topo",), ("profile", "show"), ..."""
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, prefix + (name,))


COMMANDS = list(_commands(build_parser()))


def test_the_cli_has_its_commands():
    assert {("autotune",), ("topo",), ("env",), ("profile", "show")} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "ddp-triton")
def test_help_prints_and_exits_0(command, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*command, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ddp-triton")
    assert all(f" {name}" in out for name in command)
