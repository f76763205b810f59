"""What every ``miaohui`` command prints: its consoles, and an error with its fix (exit status 2). The subcommand
modules (``dialogue/cli.py``, ``bench/cli.py``, ``generation/build/cli.py``, ``server/keys_cli.py``) use it without
importing :mod:`miaohui.cli`, which imports them."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

from miaohui.errors import MiaohuiError

console = Console()
err_console = Console(stderr=True)


def fail(exc: MiaohuiError) -> NoReturn:
    """Print ``exc``'s message and fix on stderr and end the command with status 2."""
    err_console.print(f"[bold red]error:[/] {exc.message}", soft_wrap=True)
    if exc.fix:
        err_console.print(f"[yellow]fix:[/] {exc.fix}", soft_wrap=True)
    raise typer.Exit(2) from None
