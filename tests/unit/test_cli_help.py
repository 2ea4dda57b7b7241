"""Every flag of every `pdserve` subcommand explains itself in --help."""

import argparse
import importlib

import pytest

from pdserve.cli import SUBCOMMANDS


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_flag_has_help(name: str) -> None:
    parser = argparse.ArgumentParser(prog=f"pdserve {name}")
    importlib.import_module(SUBCOMMANDS[name][0]).add_arguments(parser)
    missing = [
        "/".join(a.option_strings) or a.dest
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction) and not (a.help and a.help.strip())
    ]
    assert not missing, f"pdserve {name}: flags without help: {missing}"
