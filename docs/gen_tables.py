"""Regenerate the docs' tables that the code defines, so they cannot drift from it.

``.venv/bin/python docs/gen_tables.py`` rewrites each generated block (between its ``<!-- generated: NAME -->`` and
``<!-- end generated -->`` lines) from the code: every setting of ``Settings`` in docs/architecture.md and of
``ServeSettings`` in docs/serving.md, every command of the ``opentinker`` CLI in docs/cli.md. ``--check`` only says
which blocks differ; tests/test_docs.py fails on them.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic_settings import BaseSettings

DOCS = Path(__file__).resolve().parent
COMMAND = ".venv/bin/python docs/gen_tables.py"
END = "<!-- end generated -->"


def _cell(text: str) -> str:
    """One markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _default(value: object) -> str:
    if value is None:
        return "`None`"
    if value == "":
        return "empty"
    if isinstance(value, list):
        return "`" + ", ".join(map(str, value)) + "`"
    return f"`{value}`"


def fields_table(settings: type[BaseSettings]) -> str:
    """Every field of a pydantic-settings class: name, environment variable, default, description."""
    prefix = settings.model_config["env_prefix"]
    rows = ["| Setting | Environment variable | Default | What it sets |", "| --- | --- | --- | --- |"]
    for name, field in settings.model_fields.items():
        env = f"{prefix}{name}".upper()
        rows.append(f"| `{name}` | `{env}` | {_cell(_default(field.default))} | {_cell(field.description or '')} |")
    return "\n".join(rows)


def settings_table() -> str:
    from opentinker.infra.settings import Settings

    return fields_table(Settings)


def serve_settings_table() -> str:
    from opentinker.serving.config import ServeSettings

    return fields_table(ServeSettings)


def commands(hidden: bool = False) -> Iterator[tuple[str, object]]:
    """Every command of the ``opentinker`` CLI with its full name (``server keys create``), in the app's order;
    ``hidden``: the aliases kept for old scripts (``deploy``) too."""
    import click
    import typer

    from opentinker.cli import app

    def walk(command: click.Command, path: tuple[str, ...]) -> Iterator[tuple[str, click.Command]]:
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                if hidden or not sub.hidden:
                    yield from walk(sub, (*path, name))
        else:
            yield " ".join(path), command

    yield from walk(typer.main.get_command(app), ())


def cli_table() -> str:
    """One row per command: its arguments, its options, the first paragraph of its help."""
    import click

    rows = ["| Command | Options | What it does |", "| --- | --- | --- |"]
    for name, command in commands():
        arguments = [p.human_readable_name for p in command.params if isinstance(p, click.Argument)]
        options = [max(p.opts, key=len) for p in command.params if isinstance(p, click.Option) and not p.hidden]
        usage = " ".join([f"opentinker {name}", *arguments])
        summary = inspect.cleandoc(command.help or "").split("\n\n")[0]
        rows.append(f"| `{usage}` | {_cell(' '.join(f'`{o}`' for o in options))} | {_cell(summary)} |")
    return "\n".join(rows)


BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "settings": ("architecture.md", settings_table),
    "serve-settings": ("serving.md", serve_settings_table),
    "cli": ("cli.md", cli_table),
}


def render(text: str, name: str, table: str) -> str:
    """``text`` with block ``name`` replaced by ``table``; a missing block is an error, not a silent no-op."""
    pattern = re.compile(rf"(<!-- generated: {name} -->\n)(?:.*?\n)?({re.escape(END)})", re.S)
    if not pattern.search(text):
        raise ValueError(f"no '<!-- generated: {name} -->' ... '{END}' block")
    return pattern.sub(lambda m: f"{m.group(1)}{table}\n{m.group(2)}", text, count=1)


def stale() -> list[str]:
    """The docs whose generated blocks differ from what the code gives now."""
    differ = []
    for name, (doc, table) in BLOCKS.items():
        text = (DOCS / doc).read_text()
        if render(text, name, table()) != text:
            differ.append(f"docs/{doc}")
    return differ


def main(argv: list[str]) -> int:
    if "--check" in argv:
        differ = stale()
        for doc in differ:
            print(f"{doc} is out of date: run `{COMMAND}`")
        return 1 if differ else 0
    for name, (doc, table) in BLOCKS.items():
        path = DOCS / doc
        path.write_text(render(path.read_text(), name, table()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
