"""Model control (``POST /v2/repository/models/{m}/load|unload``) on an HTTP worker of ``--workers 2 --shared-engine``
for an encoder model: the engine process owns it, but every worker routes rows to the versions it holds, so a load
would strand the other workers on the old version. Answered with 409 naming the fix, before anything is sent to the
engine process (the socket here does not exist: reaching it would be a 503)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from miaohui.server.http import create_app
from miaohui.server.metrics import Metrics
from miaohui.server.state import ServerState
from miaohui.serving.engine_process import EngineClient
from miaohui.serving.repository import ModelManager


@pytest.mark.parametrize("action", ["load", "unload"])
async def test_encoder_control_under_shared_engine_is_409_with_the_fix(tmp_path: Path, action: str) -> None:
    (tmp_path / "intent" / "1").mkdir(parents=True)  # an encoder version folder (no causal_lm.json)
    manager = ModelManager(tmp_path, engine_process=EngineClient(str(tmp_path / "no-engine.sock")))
    app = create_app(ServerState(manager, Metrics(), worker=0, workers=2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
        r = await client.post(f"/v2/repository/models/intent/{action}")
    assert r.status_code == 409
    assert r.json() == {
        "error": "loading or unloading encoder model 'intent' is not available with --workers 2 --shared-engine: "
        "the engine process would load it, but every worker keeps its own copy of the versions it sends rows to "
        "and would keep asking for the old ones. Fix: change the repository and restart the server (chat models load "
        "and unload over the API under --shared-engine), or serve with --workers 1"
    }
