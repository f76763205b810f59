"""Name an artifact: a directory, or ``name[:version]`` in the repository (latest version by default)."""

from __future__ import annotations

from pathlib import Path

from miaohui.engines.base import MANIFEST_NAME
from miaohui.engines.store import versions
from miaohui.errors import ModelNotFoundError


def resolve_artifact(spec: str, repository: Path) -> Path:
    path = Path(spec)
    if (path / MANIFEST_NAME).is_file():
        return path
    name, _, version = spec.partition(":")
    model_dir = repository / name
    available = versions(model_dir)
    if not available:
        known = sorted(p.name for p in repository.iterdir() if p.is_dir()) if repository.is_dir() else []
        raise ModelNotFoundError(
            f"no artifact {spec!r}: not a directory with {MANIFEST_NAME}, and no model {name!r} in {repository}",
            f"build it with `miaohui build ... --name {name}`" + (f" (known: {', '.join(known)})" if known else ""),
        )
    if version:
        if not version.isdigit() or int(version) not in available:
            raise ModelNotFoundError(
                f"model {name!r} has no version {version!r}",
                f"available versions: {', '.join(map(str, available))}",
            )
        return model_dir / version
    return model_dir / str(available[-1])
