"""`nixlkv --help` groups the commands by what a user wants, and every command names the page that explains it."""

from __future__ import annotations

from pathlib import Path

import pytest

from nixlkv.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]


def _subcommands() -> dict:
    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return action.choices


def test_every_command_is_in_one_group() -> None:
    grouped = [name for cmds in COMMANDS.values() for name, _, _ in cmds]
    assert sorted(grouped) == sorted(_subcommands()), "a command missing from COMMANDS, or listed twice"
    assert [g.split()[0] for g in COMMANDS] == ["plan", "prove", "serve", "measure"]


def test_overview_lists_every_command_under_its_group() -> None:
    text = build_parser().format_help()
    for group, cmds in COMMANDS.items():
        assert f"{group}:" in text
        for name, _, page in cmds:
            assert f"  {name} " in text and page in text


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_command_help_names_an_existing_page(name: str) -> None:
    text = _subcommands()[name].format_help()
    pages = [w.strip(".,()") for w in text.replace("\n", " ").split() if w.startswith("docs/")]
    assert pages, f"`nixlkv {name} --help` names no docs page"
    for page in pages:
        assert (ROOT / page).is_file(), f"`nixlkv {name} --help` names {page}, which does not exist"
