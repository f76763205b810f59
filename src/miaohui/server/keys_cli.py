"""``miaohui keys``: add and list the API keys of a server's key file (registered by :mod:`miaohui.cli`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from miaohui.cli_output import console, fail
from miaohui.errors import ConfigError, MiaohuiError

keys_app = typer.Typer(help="API keys of a server's key file (--api-keys): add, list.", no_args_is_help=True)
KeyFileOpt = Annotated[Path, typer.Option("--file", "-f", help="The key file (made when missing).")]


@keys_app.command("add")
def keys_add(
    file: KeyFileOpt,
    tenant: Annotated[str, typer.Option(help="Tenant name (in logs and metrics; the key never is).")],
    models: Annotated[str, typer.Option(help="Comma-separated models / pipeline/<name> it may use; * = all.")] = "*",
    requests_per_s: Annotated[float, typer.Option(min=0, help="Rate limit; 0 = none.")] = 0.0,
    tokens_per_minute: Annotated[
        int | None, typer.Option(min=1, help="Prompt + completion tokens a minute on chat/completions; none if unset.")
    ] = None,
    priority: Annotated[str, typer.Option(help="interactive or bulk.")] = "interactive",
) -> None:
    """Add a key: prints the key once (only its SHA-256 is stored)."""
    from miaohui.server.auth import ApiKey, KeyFile, hash_key, new_key

    try:
        keys = KeyFile.load(file) if file.exists() else KeyFile()
        key = new_key()
        entry = ApiKey.model_validate(
            {
                "tenant": tenant,
                "sha256": hash_key(key),
                "models": [m.strip() for m in models.split(",") if m.strip()],
                "requests_per_s": requests_per_s,
                "tokens_per_minute": tokens_per_minute,
                "priority": priority,
            }
        )
    except MiaohuiError as exc:
        fail(exc)
    except ValueError as exc:
        fail(ConfigError(f"bad key settings: {str(exc).splitlines()[0]}", "see `miaohui keys add --help`"))
    keys.keys.append(entry)
    keys.save(file)
    console.print(key)


@keys_app.command("list")
def keys_list(file: KeyFileOpt) -> None:
    """The keys of a key file: tenant, models, rates, priority (never the keys, which are not stored)."""
    from miaohui.server.auth import KeyFile

    try:
        keys = KeyFile.load(file)
    except MiaohuiError as exc:
        fail(exc)
    for k in keys.keys:
        tpm = f"{k.tokens_per_minute} tokens/min" if k.tokens_per_minute else "no token limit"
        console.print(
            f"{k.tenant}\t{','.join(k.models)}\t{k.requests_per_s:g}/s\t{tpm}\t{k.priority}\t{k.sha256[:12]}…"
        )
