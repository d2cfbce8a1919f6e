"""The deployment files: Kubernetes manifests valid against the API's schemas and built by kustomize,
and everything the image, compose and the manifests name agreeing with each other and with the
gateway's config."""

from __future__ import annotations

import copy
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from specgate.calibration.modes import Pool
from specgate.cli.serve import ADMIN_TOKEN_ENV, API_KEYS_ENV
from specgate.gateway.config import admin_token, env_keys, parse_settings
from specgate.workers.discovery import DnsName

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())
KUBERNETES = "1.33"
"""The oldest Kubernetes the manifests are checked against (every release since keeps these APIs)."""


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> list[Path]:
    """Every manifest file (kustomizations aside)."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("path", manifests(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_validator_catches_what_it_must() -> None:
    """A misspelled field and a wrong type are refused: the check above can fail."""
    deployment = next(d for d in documents(K8S / "base" / "gateway.yaml") if d["kind"] == "Deployment")
    misspelled = copy.deepcopy(deployment)
    misspelled["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    for bad in (misspelled, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBERNETES, strict=True)


def built(overlay: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize built in) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_overlay_builds_into_a_valid_coherent_deployment(overlay: Path) -> None:
    docs = built(overlay)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "specgate-gateway"), ("Service", "specgate"), ("PodDisruptionBudget", "specgate-gateway"),
            ("HorizontalPodAutoscaler", "specgate-gateway"), ("Deployment", "redis"),
            ("Deployment", "vllm-speculative"), ("Deployment", "vllm-plain")} <= kinds  # fmt: skip
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"specgate"}
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    settings = parse_settings(tomllib.loads(config_map["data"]["gateway.toml"]))
    gateway = by_name[("Deployment", "specgate-gateway")]["spec"]
    assert gateway["replicas"] >= 2
    pod = gateway["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_grace_s
    # the gateway mounts the generated ConfigMap (its name carries kustomize's hash) where it reads it
    volumes = {v["name"]: v for v in pod["volumes"]}
    (volume,) = (v for v in volumes.values() if "configMap" in v)
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    # a read-only root still leaves the gateway a writable /tmp (`serve --workers N` needs one)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    (tmp,) = (m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "emptyDir" in volumes[tmp["name"]]
    assert f"{container['volumeMounts'][0]['mountPath']}/gateway.toml" == container["args"][-1]
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]} == {secret["metadata"]["name"]}
    assert settings.port == container["ports"][0]["containerPort"]
    # each pool's DNS name is a headless Service whose selector picks that pool's pods, on their port
    for pool in Pool:
        (name,) = settings.discovery[pool]
        assert isinstance(name, DnsName)
        service = by_name[("Service", name.name)]["spec"]
        assert service["clusterIP"] == "None"
        assert service["ports"][0]["port"] == name.port
        servers = by_name[("Deployment", f"vllm-{pool.value}")]["spec"]["template"]
        assert service["selector"].items() <= servers["metadata"]["labels"].items()
        server = servers["spec"]["containers"][0]
        assert server["ports"][0]["containerPort"] == service["ports"][0]["targetPort"]
        args = " ".join(server["args"])
        assert f"--port={name.port}" in args or f"--port {name.port}" in args
        assert ("--speculative-config" in args or "--mode speculative" in args) is (pool is Pool.SPECULATIVE)
        assert settings.models[0] in args  # the servers answer to the name the gateway serves
    assert settings.store.url == "redis://redis:6379/0"
    assert ("Service", "redis") in by_name


def test_the_gpu_pools_ask_for_a_gpu_each() -> None:
    for doc in documents(K8S / "overlays" / "gpu" / "vllm.yaml"):
        limits = doc["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1


def test_the_example_secrets_are_what_the_gateway_accepts() -> None:
    values = dict(line.split("=", 1) for line in (K8S / "base" / "secrets.env").read_text().splitlines()
                  if line and not line.startswith("#"))  # fmt: skip
    admin_token(ADMIN_TOKEN_ENV, values[ADMIN_TOKEN_ENV])
    assert env_keys(API_KEYS_ENV, values[API_KEYS_ENV]) == {}


def test_the_image_copies_every_room_and_runs_without_privileges() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    copied = {shlex.split(line)[1] for line in lines if line.startswith("COPY ") and "--from" not in line}
    rooms = {p.name for p in (ROOT / "specgate").iterdir() if p.is_symlink()}
    assert rooms <= copied
    assert all((ROOT / c).exists() for c in copied)
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert copied <= allowed
    user = next(line for line in reversed(lines) if line.startswith("USER "))
    assert user.split()[1] not in ("root", "0")
    assert any(line.startswith("ENTRYPOINT") and "specgate" in line for line in lines)


def test_compose_runs_two_gateways_and_the_pools_they_discover() -> None:
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    services = compose["services"]
    gateways = [name for name, s in services.items() if s.get("command", [""])[0] == "serve"]
    assert len(gateways) == 2
    mount = services[gateways[0]]["volumes"][0].split(":")
    settings = parse_settings(tomllib.loads((COMPOSE / mount[0]).read_text()))
    assert mount[1] == services[gateways[0]]["command"][-1]
    assert settings.host == "0.0.0.0"
    for gateway in gateways:  # a read-only root still leaves a writable /tmp (`serve --workers N`)
        assert services[gateway]["read_only"] is True
        assert "/tmp" in services[gateway]["tmpfs"]
    for pool in Pool:
        (name,) = settings.discovery[pool]
        assert isinstance(name, DnsName)
        command = services[name.name]["command"]
        assert command[command.index("--mode") + 1] == pool.value
        assert command[command.index("--port") + 1] == str(name.port)
        assert command[command.index("--model") + 1] == settings.models[0]
    assert settings.store.url is not None
    assert settings.store.url.split("//")[1].split(":")[0] in services
    # the GPU override replaces the simulated pools under the names the gateways discover
    gpu = yaml.safe_load((COMPOSE / "compose.gpu.yaml").read_text())["services"]
    assert set(gpu) == {n.name for p in Pool for n in settings.discovery[p] if isinstance(n, DnsName)}
    assert any("--speculative-config" in arg for arg in gpu["pool-speculative"]["command"])
    assert not any("--speculative-config" in arg for arg in gpu["pool-plain"]["command"])
