"""deploy/: the Prometheus rules checked and unit-tested by the real ``promtool``, the server's real
/metrics output linted by it, the Grafana queries parsed by it, and the Kubernetes manifests checked
against the server's ports, health routes and model config schema.

``promtool`` comes from ``scripts/install_prometheus.sh`` (Debian package ``prometheus``; ``make test``
runs it). Without it these tests are skipped, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from miaohui.server.metrics import Metrics
from miaohui.serving.model_config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yaml"
EXPECTED_ALERTS = {
    "MiaohuiDown",
    "MiaohuiNoReadyReplicas",
    "MiaohuiHighP99Latency",
    "MiaohuiSlowFirstToken",
    "MiaohuiSlowTokenStream",
    "MiaohuiHighErrorRate",
    "MiaohuiQueueFull",
    "MiaohuiDeadlinesExceeded",
    "MiaohuiGpuHot",
    "MiaohuiComplianceInterventionsSpike",
    "MiaohuiLongGcPauses",
}
_METRIC = re.compile(r"\bmiaohui_[a-z0-9_]+")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed: run `bash scripts/install_prometheus.sh` (make test does)")
    return path


def _run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, input=stdin.decode() if stdin is not None else None, capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def _busy_metrics() -> Metrics:
    """A real registry with a sample in every labelled family (as after some traffic)."""
    m = Metrics()
    m.done("intent", "1", "http", 200, 0.004)
    m.done("intent", "1", "grpc", 429, 0.001, reason="queue_full")
    obs = m.observer("intent", 1)
    obs.on_enqueue(3)
    obs.on_batch(size=4, tokens=40, padded_tokens=48, queue_wait_s=[0.001, 0.002, 0.002, 0.003])
    obs.on_compute(0.003, 4, True)
    obs.on_reject("queue_full")
    m.in_flight.labels("intent").inc()
    m.ttft.labels("chat").observe(0.05)
    m.itl.labels("chat").observe(0.01)
    m.e2e.labels("chat").observe(0.5)
    m.prompt_tokens.labels("chat").inc(12)
    m.generated_tokens.labels("chat").inc(30)
    m.running.labels("chat").set(2)
    m.waiting.labels("chat").set(1)
    m.prefill_seqs.labels("chat").observe(2)
    m.stage_seconds.labels("bank_advisor", "intent").observe(0.002)
    m.interventions.labels("bank_advisor", "no_guaranteed_return", "rewrite").inc()
    m.shadow.labels("intent", "agreement").set(0.99)
    m.gc_pause.labels("2").observe(0.0005)
    return m


# ---------------------------------------------------------------------------------------------- rules


def test_rules_pass_promtool_check(promtool: str) -> None:
    result = _run(promtool, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 20 rules found" in result.stdout


def test_rule_unit_tests_fire_and_stay_quiet(promtool: str) -> None:
    result = _run(promtool, "test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_test() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == EXPECTED_ALERTS
    tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yaml").read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case["exp_alerts"]}
    assert fired == alerts
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["labels"]["severity"] in ("page", "warning"), rule["alert"]
                assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_prometheus_config_is_valid(promtool: str) -> None:
    result = _run(promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------- metrics


def test_server_metrics_pass_promtool_lint(promtool: str) -> None:
    text = _busy_metrics().render()
    assert b"miaohui_request_duration_seconds_bucket" in text
    result = _run(promtool, "check", "metrics", stdin=text)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def _exported_names() -> set[str]:
    names = {s.name for fam in _busy_metrics().registry.collect() for s in fam.samples}
    # NVML gauges exist only where a GPU is present: take their names from the collector's source
    source = (ROOT / "src" / "miaohui" / "server" / "metrics.py").read_text()
    names |= set(re.findall(r'"(miaohui_gpu_[a-z_]+)"', source))
    return names


def _dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "miaohui.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_rules_and_dashboard_use_only_exported_metrics() -> None:
    exported = _exported_names()
    rules = yaml.safe_load(RULES.read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]] + _dashboard_exprs()
    used = {name for e in exprs for name in _METRIC.findall(e)}
    assert used, "no miaohui_ metric referenced"
    missing = sorted(used - exported)
    assert not missing, f"referenced but not exported by miaohui.server.metrics: {missing}"


# ---------------------------------------------------------------------------------------------- grafana


def test_dashboard_queries_parse(promtool: str, tmp_path: Path) -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) >= 12
    rules = [
        {"record": f"dashboard:query_{i}:check", "expr": e.replace("$__rate_interval", "1m").replace("$model", ".*")}
        for i, e in enumerate(exprs)
    ]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_structure() -> None:
    dash = json.loads((DEPLOY / "grafana" / "miaohui.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "model"}
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("latency", "throughput", "batch", "queue", "error", "gpu"):
        assert topic in titles, topic
    for p in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


# ---------------------------------------------------------------------------------------------- kubernetes


def _k8s() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "base" / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / "k8s" / "base" / name).read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), name
            docs[doc["kind"]] = doc
    return docs


def test_k8s_manifests_match_the_server() -> None:
    docs = _k8s()
    assert set(docs) == {
        "ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Secret", "Ingress",
    }  # fmt: skip
    deploy, service = docs["Deployment"], docs["Service"]
    pod = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    args = container["args"]
    assert args[args.index("--port") + 1] == "8000" and args[args.index("--grpc-port") + 1] == "8001"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    volumes = {v["name"] for v in pod["spec"]["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= volumes


def test_k8s_model_config_is_a_valid_model_config() -> None:
    data = yaml.safe_load(_k8s()["ConfigMap"]["data"]["config.yaml"])
    cfg = ModelConfig.model_validate(data)
    assert cfg.dynamic_batching and cfg.batching.max_batch_size == 32
