"""The chat target's pieces that need no server, and ``--model`` honoured by the engine target."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from miaohui.bench.chat import error_message, parse_extra_body
from miaohui.cli import app
from miaohui.errors import ConfigError


def test_error_message_reads_openai_and_plain_bodies() -> None:
    assert error_message(b'{"error": {"message": "The model \'x\' does not exist", "code": "x"}}') == (
        "The model 'x' does not exist"
    )
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"Bad Gateway") == "Bad Gateway"


def test_extra_body_must_be_a_json_object() -> None:
    assert parse_extra_body('{"top_k": 1}') == {"top_k": 1}
    fix = """write e.g. --extra-body '{"top_k": 1}'"""
    with pytest.raises(ConfigError) as exc:
        parse_extra_body("[1]")
    assert (exc.value.message, exc.value.fix) == ("--extra-body '[1]' is not a JSON object", fix)
    with pytest.raises(ConfigError, match=r"^--extra-body '\{' is not JSON \(Expecting property name"):
        parse_extra_body("{")


def test_the_engine_target_finds_model_in_the_repository(tmp_path: Path) -> None:
    done = CliRunner().invoke(app, ["bench", "--target", "engine", "--model", "nope", "--repository", str(tmp_path)])
    assert done.exit_code == 2, done.output
    assert f"no artifact 'nope': not a directory with manifest.json, and no model 'nope' in {tmp_path}" in " ".join(
        done.output.split()
    )
