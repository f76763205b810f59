"""docs/model-repository.md is generated from the repository configs' docstrings (scripts/gen_config_docs.py): the
committed page must be what the generator writes today, and the generator must really read the fields."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel, Field

from miaohui.generation.build.artifact import GenerationModelConfig
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.serving.batcher import BatcherConfig
from miaohui.serving.model_config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_config_docs.py"
PAGE = ROOT / "docs" / "model-repository.md"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page(gen: ModuleType) -> str:
    return str(gen.render())


def test_committed_page_is_up_to_date(page: str) -> None:
    committed = PAGE.read_text(encoding="utf-8")
    assert committed == page, (
        "docs/model-repository.md is out of date with the config docstrings in src/miaohui: "
        "run `make docs` (python scripts/gen_config_docs.py) and commit the page"
    )


@pytest.mark.parametrize("cls", [ModelConfig, BatcherConfig, GenerationModelConfig, SchedulerConfig, SlotEngineOptions])
def test_every_field_of_each_config_is_on_the_page(page: str, cls: type[BaseModel]) -> None:
    assert f"### {cls.__name__}\n" in page
    for name in cls.model_fields:
        assert f"- **`{name}`** (" in page, f"{cls.__name__}.{name} missing"


def test_a_field_shows_its_type_bounds_default_and_docstring(gen: ModuleType) -> None:
    lines = gen.model_section(BatcherConfig)
    assert "- **`max_batch_size`** (int, ≥ 1, default `32`): Most requests in one batch." in lines
    assert any(line.startswith("- **`max_batch_tokens`** (int \\| null, ≥ 1, default `null`): ") for line in lines)


class _Inner(BaseModel):
    """An inner block."""

    depth: int = Field(default=2, ge=0, le=9)
    """How deep; ``:class:`` roles become code."""


class _Outer(BaseModel):
    mode: str = "a"
    """First line.
    Second line of the same field."""
    inner: _Inner = Field(default_factory=_Inner)
    needed: float


def test_nested_models_docstrings_and_rst_roles(gen: ModuleType) -> None:
    docs = gen.attribute_docstrings(_Outer)
    assert docs == {"mode": "First line.\nSecond line of the same field."}
    assert gen.model_section(_Outer) == [
        "### _Outer",
        "",
        '- **`mode`** (string, default `"a"`): First line.',
        "  Second line of the same field.",
        "- **`inner`** ([_Inner](#_inner), default: every field at its default)",
        "- **`needed`** (float, required)",
        "",
    ]
    assert (
        gen.model_section(_Inner)[4]
        == "- **`depth`** (int, ≥ 0, ≤ 9, default `2`): How deep; `:class:` roles become code."
    )
    assert gen._rst_to_md("see :class:`~miaohui.serving.model_config.ShadowConfig` and :mod:`miaohui.gil`") == (
        "see `ShadowConfig` and `miaohui.gil`"
    )


def test_check_mode_fails_on_a_stale_page_and_names_the_command(
    gen: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "model-repository.md"
    stale.write_text("# old\n", encoding="utf-8")
    assert gen.main(["--out", str(stale), "--check"]) == 1
    assert f"{stale} is out of date: run `make docs` (python scripts/gen_config_docs.py)" in capsys.readouterr().err
    assert gen.main(["--out", str(stale)]) == 0
    assert gen.main(["--out", str(stale), "--check"]) == 0
