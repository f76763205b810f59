"""API keys and TLS on a real ``miaohui serve --api-keys FILE --tls-cert C --tls-key K`` (tiny intent model; a
self-signed certificate for localhost made by openssl), with the key file written by the real ``miaohui keys add``
and the real clients over TLS: ``openai`` (Authorization: Bearer) and ``tritonclient.grpc`` (``ssl=True``,
``headers=`` metadata), plus httpx for the exact messages; a plain-text client is refused. Checked: 401 without or with a wrong key, 403 for a model
or pipeline the key may not use, 429 with ``Retry-After`` over the key's rate, health and ``/metrics`` open, every
rejection counted in ``miaohui_request_failures_total`` by reason and in ``miaohui_rejected_requests_total`` by
tenant and status, and no key in the log or the metrics.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from tests.e2e.test_workers import ROOT, Served, free_port
from tritonclient.utils import InferenceServerException

from miaohui.bench.scrape import parse_metrics
from miaohui.config import BuildConfig
from miaohui.engines.store import build_artifact
from miaohui.server.auth import Authenticator, KeyFile
from miaohui.serving.model_config import ModelConfig, write_model_config


def add_key(file: Path, tenant: str, *options: str) -> str:
    cmd = [sys.executable, "-m", "miaohui.cli", "keys", "add", "--file", str(file), "--tenant", tenant, *options]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, env=os.environ.copy())
    return out.stdout.strip()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    made = {
        "hotline": add_key(file, "hotline", "--models", "intent,pipeline/gov_hotline"),
        "bulk": add_key(file, "bulk", "--models", "intent", "--requests-per-s", "0.05", "--priority", "bulk"),
    }
    return file, made


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    cmd = [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
    cmd += ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(d / "key.pem")]
    subprocess.run([*cmd, "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def trust(cert: tuple[Path, Path]) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert[0]))


@pytest.fixture(scope="module")
def server(
    tiny_model: Path,
    keys: tuple[Path, dict[str, str]],
    cert: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("auth-repo")
    build_artifact(tiny_model, "intent", BuildConfig(precision="fp32"), root, log=lambda m: None)
    write_model_config(root / "intent" / "config.yaml", ModelConfig(threads=1))
    port, grpc_port = free_port(), free_port()
    log = root / "server.log"
    cmd = [sys.executable, "-m", "miaohui.cli", "serve", "-r", str(root), "--port", str(port)]
    cmd += ["--grpc-port", str(grpc_port), "--api-keys", str(keys[0])]
    cmd += ["--tls-cert", str(cert[0]), "--tls-key", str(cert[1])]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ.copy())
    served = Served(proc, f"https://localhost:{port}", f"localhost:{grpc_port}", log)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(served.url + "/v2/health/ready", verify=trust(cert), timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"server not ready:\n{log.read_text()}")
        yield served
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def http(cert: tuple[Path, Path]) -> Iterator[httpx.Client]:
    with httpx.Client(verify=trust(cert), timeout=10) as client:
        yield client


def test_plain_text_is_refused(server: Served) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert not s.recv(64).startswith(b"HTTP/1.1 200")


def test_key_file_holds_hashes_only(keys: tuple[Path, dict[str, str]]) -> None:
    file, made = keys
    text = file.read_text()
    assert all(k not in text for k in made.values())
    stored = KeyFile.load(file)
    assert [(k.tenant, k.models, k.priority) for k in stored.keys] == [
        ("hotline", ["intent", "pipeline/gov_hotline"], "interactive"),
        ("bulk", ["intent"], "bulk"),
    ]
    assert Authenticator(stored).tenant(f"Bearer {made['bulk']}").name == "bulk"


def test_http_keys(server: Served, keys: tuple[Path, dict[str, str]], http: httpx.Client) -> None:
    made = keys[1]
    url = server.url
    assert http.get(url + "/v2/health/ready").status_code == 200  # probes need no key
    r = http.get(url + "/v2/models/intent")
    assert (r.status_code, r.json()) == (
        401,
        {
            "error": "no API key: the request has no Authorization header. Fix: send Authorization: Bearer <your key> "
            "(the openai client's api_key; gRPC metadata authorization)"
        },
    )
    r = http.get(url + "/v2/models/intent", headers={"Authorization": "Bearer mh-wrong"})
    assert (r.status_code, r.json()["error"]) == (
        401,
        "the API key is not valid. Fix: check the key, or ask the operator for one",
    )
    hotline = {"Authorization": f"Bearer {made['hotline']}"}
    assert http.get(url + "/v2/models/intent", headers=hotline).status_code == 200
    r = http.post(url + "/v1/dialogue/meeting_assistant", headers=hotline, json={"text": "帮我订个会议室"})
    assert (r.status_code, r.json()["error"]) == (
        403,
        "tenant 'hotline' may not use model 'pipeline/meeting_assistant'. Fix: use one of intent, "
        "pipeline/gov_hotline, or ask the operator to add it to this key",
    )
    bulk = {"Authorization": f"Bearer {made['bulk']}"}
    assert http.get(url + "/v2/models/intent", headers=bulk).status_code == 200
    r = http.get(url + "/v2/models/intent", headers=bulk)  # one request per 20 s
    assert (r.status_code, r.headers["retry-after"]) == (429, "20")
    assert r.json()["error"] == (
        "tenant 'bulk' is over its limit of 0.05 requests/s. Fix: retry after 20 s, or ask the operator for a higher "
        "limit"
    )


def test_openai_client(server: Served, keys: tuple[Path, dict[str, str]], http: httpx.Client) -> None:
    def client_with(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, http_client=http)

    with pytest.raises(openai.AuthenticationError) as exc:
        client_with("unused").models.list()
    assert exc.value.status_code == 401
    assert exc.value.body == {  # OpenAI's error shape on the OpenAI routes
        "message": "the API key is not valid. Fix: check the key, or ask the operator for one",
        "type": "invalid_request_error",
        "param": None,
        "code": "unauthorized",
    }
    client = client_with(keys[1]["hotline"])
    assert "intent" in [m.id for m in client.models.list()]
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.chat.completions.create(model="pipeline/bank_advisor", messages=[{"role": "user", "content": "hi"}])
    assert denied.value.status_code == 403


def test_grpc_keys(server: Served, keys: tuple[Path, dict[str, str]], cert: tuple[Path, Path]) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url, ssl=True, root_certificates=str(cert[0]))
    assert client.is_server_live()  # liveness needs no key
    inputs = [grpcclient.InferInput("TEXT", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([b"hello"], dtype=object))
    with pytest.raises(InferenceServerException) as exc:
        client.infer("intent", inputs)
    assert exc.value.status() == "StatusCode.UNAUTHENTICATED"
    assert exc.value.message().startswith("no API key: the request has no Authorization header")
    hotline = {"authorization": f"Bearer {keys[1]['hotline']}"}
    assert client.is_model_ready("intent", headers=hotline)
    result = client.infer("intent", inputs, headers=hotline)
    assert result.as_numpy("CONFIDENCE").shape == (1,)
    with pytest.raises(InferenceServerException) as exc:
        client.get_model_metadata("other", headers=hotline)
    assert exc.value.status() == "StatusCode.PERMISSION_DENIED"


def test_rejections_counted_and_no_key_leaks(
    server: Served, keys: tuple[Path, dict[str, str]], http: httpx.Client
) -> None:
    text = http.get(server.url + "/metrics").text
    snap = parse_metrics(text)
    log = server.log.read_text()
    for key in keys[1].values():
        assert key not in text and key not in log
    failures = {
        reason: snap.total("miaohui_request_failures_total", reason=reason)
        for reason in ("unauthorized", "forbidden", "rate_limited")
    }  # what the tests above sent: 2 + 1 + 1 without a valid key, 1 + 1 + 1 forbidden, 1 over the rate
    assert failures == {"unauthorized": 4.0, "forbidden": 3.0, "rate_limited": 1.0}
    by_tenant = {
        (dict(labels)["tenant"], dict(labels)["code"], dict(labels)["reason"]): value
        for labels, value in snap.select("miaohui_rejected_requests_total").items()
    }
    assert by_tenant == {
        ("(none)", "401", "unauthorized"): 4.0,
        ("hotline", "403", "forbidden"): 3.0,
        ("bulk", "429", "rate_limited"): 1.0,
    }
