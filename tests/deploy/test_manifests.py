"""The Kubernetes manifests and the compose stack, offline: built-in kinds validate strictly
against the Kubernetes schemas (kubernetes-validate); custom resources (PodMonitor,
InferencePool), which have no schema here, and every cross-reference (labels, port names, the
grace period against the drain, the autoscaler's metric) are checked against what they point
at."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest

from engine.metrics import EngineMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CUSTOM_KINDS = {"PodMonitor", "InferencePool"}


def documents() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str, name: str | None = None) -> dict:
    (doc,) = [
        d for d in documents()
        if d["kind"] == kind and name in (None, d["metadata"]["name"])
    ]  # fmt: skip
    return doc


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_built_in_kinds_validate_strictly(doc):
    version = kubernetes_validate.latest_version()
    if doc["kind"] in CUSTOM_KINDS:
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc, version, strict=True)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def pod_labels() -> dict:
    return by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]


def container() -> dict:
    (c,) = by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


# Kubernetes' meaning of each probe, and the route that answers it: liveness restarts the pod,
# so it asks only whether the engine is alive; readiness (draining, a stalled engine) only
# stops new traffic.
PROBES = {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}


def test_the_deployment_drains_within_its_grace_period_and_probes_liveness_and_readiness():
    spec = by_kind("Deployment")["spec"]["template"]["spec"]
    # The pod runs the image's command with KV events added: the same drain in both.
    command = " ".join(container()["command"])
    drain = int(re.search(r"--shutdown-timeout (\d+)", command)[1])
    assert f"--shutdown-timeout {drain}" in (DEPLOY / "Dockerfile").read_text()
    pre_stop = container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop + drain < spec["terminationGracePeriodSeconds"]
    ports = {p["name"] for p in container()["ports"]}
    for probe, path in PROBES.items():
        assert container()[probe]["httpGet"] == {"path": path, "port": "http"}
        assert container()[probe]["httpGet"]["port"] in ports
    key = container()["env"][0]
    assert key["name"] == "KVSERVE_API_KEY" and "secretKeyRef" in key["valueFrom"]
    assert container()["resources"]["requests"]["nvidia.com/gpu"] == "1"


def test_service_monitor_and_pool_point_at_the_pods():
    labels, ports = pod_labels(), {p["name"]: p["containerPort"] for p in container()["ports"]}
    service = by_kind("Service")["spec"]
    assert service["selector"].items() <= labels.items()
    assert all(p["targetPort"] in ports for p in service["ports"])
    monitor = by_kind("PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in monitor["podMetricsEndpoints"]] == ["http"]
    assert monitor["podMetricsEndpoints"][0]["path"] == "/metrics"
    pool = by_kind("InferencePool")["spec"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["targetPorts"]] == [ports["http"]]
    assert (
        by_kind("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    )


def exported() -> set[str]:
    text = generate_latest(EngineMetrics().registry).decode()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}


def test_the_autoscaler_reads_a_metric_the_adapter_makes_from_one_we_export():
    hpa = by_kind("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["name"] == by_kind("Deployment")["metadata"]["name"]
    (metric,) = hpa["metrics"]
    adapter = yaml.safe_load(
        by_kind("ConfigMap", "prometheus-adapter-kvserve")["data"]["config.yaml"]
    )
    (rule,) = adapter["rules"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    source = re.match(r"'?([a-z_:]+)\{", rule["seriesQuery"])[1]
    assert source in exported()


def test_the_endpoint_picker_finds_its_metrics_and_each_pods_kv_events():
    """The picker's default (vLLM) metric names are exported; its KV-events scorer selects the
    pods by a label they carry, on the port they publish on, at kvserve's block size, and the
    topic each pod publishes under is llm-d's kv@<pod IP>@<model>."""
    inference_pool = (DEPLOY / "k8s" / "inference-pool.yaml").read_text()
    names = set(re.findall(r"(vllm:[a-z_]+)", inference_pool))
    assert names == {"vllm:num_requests_waiting", "vllm:num_requests_running",
                     "vllm:kv_cache_usage_perc", "vllm:cache_config_info"}  # fmt: skip
    assert names - {"vllm:cache_config_info"} <= exported()
    assert "vllm:cache_config_info" in exported() or "vllm:cache_config" in exported()
    config = yaml.safe_load(by_kind("ConfigMap", "kvserve-epp-config")["data"]["epp-config.yaml"])
    (scorer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    events = scorer["parameters"]["kvEventsConfig"]
    key, value = events["podDiscoveryConfig"]["podLabelSelector"].split("=")
    assert pod_labels()[key] == value
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert events["podDiscoveryConfig"]["socketPort"] == ports["kv-events"] == 5557
    assert scorer["parameters"]["indexerConfig"]["tokenProcessorConfig"]["blockSizeTokens"] == 16
    command = " ".join(container()["command"])
    assert '\\"topic\\": \\"kv@$POD_IP@$MODEL\\"' in command
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in (
        container()["env"]
    )


def test_the_compose_stack_wires_its_parts_together():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    assert set(compose) == {"kvserve", "prometheus", "grafana"}
    for service in compose.values():
        for volume in service.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), volume
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    target = scrape["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert target == "kvserve:8000" and "8000:8000" in compose["kvserve"]["ports"]
    datasource = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
    assert "http://prometheus:9090" in datasource.read_text()
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvserve.yml").read_text()
    )
    mounted = {v.split(":")[1] for v in compose["grafana"]["volumes"]}
    assert provider["providers"][0]["options"]["path"] in mounted
