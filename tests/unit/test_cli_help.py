"""Every option of every ``fedpca`` command says what it does in ``--help``.

Found by a new user's walkthrough: ``analyst pca --clip-norm`` had no help at all and
``--components`` said only "k."; 18 options of 9 commands had none."""

from __future__ import annotations

from collections.abc import Iterator

import click

from fedpca.app.cli import main


def _commands(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
    if isinstance(command, click.Group):
        context = click.Context(command, info_name=path)
        for name in command.list_commands(context):
            sub = command.get_command(context, name)
            assert sub is not None, f"{path} {name}"
            yield from _commands(sub, f"{path} {name}")
    else:
        yield path, command


def test_every_option_has_help() -> None:
    commands = dict(_commands(main, "fedpca"))
    assert {"fedpca analyst pca", "fedpca proxy init", "fedpca demo"} <= set(commands)
    silent = [
        f"{path} {option.opts[0]}"
        for path, command in commands.items()
        for option in command.params
        if isinstance(option, click.Option) and not (option.help or "").strip()
    ]
    assert silent == []


def test_the_wait_for_owners_help_states_the_wait_the_code_uses() -> None:
    """A new user's walkthrough: every query command's help said 15 s; it waits 40 s."""
    from fedpca.analyst.owner_wait import OWNERS_CONNECT_SECONDS

    helps = {
        path: option.help or ""
        for path, command in _commands(main, "fedpca")
        for option in command.params
        if isinstance(option, click.Option) and option.opts[0] == "--wait-for-owners"
    }
    assert {"fedpca analyst pca", "fedpca analyst stats"} <= set(helps)
    for path, text in helps.items():
        assert f"waits {OWNERS_CONNECT_SECONDS:g} s for them" in text, path
