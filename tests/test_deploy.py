"""deploy/: the Kubernetes manifests validate against the Kubernetes schemas (offline), hang together
(volumes, Secrets, ports, the GPU hosts' Service name in the edge's config) and carry configs this
server accepts; the container files make non-root, read-only-root images; and the package they
install serves outside the source tree. The images themselves, built and run: tests/test_images.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from config.loader import parse_config
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
IMAGES = {"cpu": DEPLOY / "Containerfile", "gpu": DEPLOY / "Containerfile.gpu"}


def documents() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def workloads() -> list[dict]:
    return [d for d in documents() if d["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
def test_every_manifest_validates_against_the_kubernetes_schemas(version):
    import kubernetes_validate
    docs = documents()
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Deployment", "Service", "Secret", "ConfigMap", "PodDisruptionBudget",
            "PersistentVolumeClaim"} <= kinds, kinds
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)   # raises with the path that is wrong


def test_the_manifests_hang_together():
    config_maps, secrets, claims = by_kind("ConfigMap"), by_kind("Secret"), by_kind("PersistentVolumeClaim")
    services = by_kind("Service")
    for w in workloads():
        pod = w["spec"]["template"]
        assert w["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory", "/dev/shm sized by the manifest"
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in config_maps
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets
                data = secrets[v["secret"]["secretName"]]["stringData"]
                assert {i["key"] for i in v["secret"].get("items", [])} <= set(data)
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
        for c in spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
            assert {m["name"] for m in c["volumeMounts"]} <= set(volumes)
            assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/dev/shm", "/tmp"}, "writable: sockets, rings"
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", None)):
                get = c[probe]["httpGet"]
                assert get["port"] in ports and (path is None or get["path"] == path)
            assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert spec["terminationGracePeriodSeconds"] > _config(w)["supervisor"]["shutdown_timeout_s"]
    gpu = next(w for w in workloads() if w["kind"] == "StatefulSet")
    assert gpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    headless = services[gpu["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    edge = next(w for w in workloads() if w["kind"] == "Deployment")
    host = _config(edge)["bridge"]["hosts"][0]
    assert host["dns"] == f"{headless['metadata']['name']}.{headless['metadata']['namespace']}.svc.cluster.local"
    assert host["port"] == headless["spec"]["ports"][0]["port"] == _port(_config(gpu)["bridge"]["bind"])
    assert {d.get("kind") for d in documents() if d["kind"] == "PodDisruptionBudget"}


def _config(workload: dict) -> dict:
    volumes = workload["spec"]["template"]["spec"]["volumes"]
    name = next(v["configMap"]["name"] for v in volumes if "configMap" in v)
    return yaml.safe_load(by_kind("ConfigMap")[name]["data"]["config.yaml"])


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_the_config_maps_are_configs_this_server_accepts():
    for w in workloads():
        data = _config(w)
        config = parse_config(data, base_dir="/")
        role = w["spec"]["template"]["spec"]["containers"][0]["args"][1]
        assert role in ("gpu", "edge")
        mounts = {m["mountPath"] for m in w["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert config.models_dir in mounts
        keys = [config.bridge.secret_key, config.bridge.authorized_keys] if role == "gpu" else \
            [config.bridge.client_secret_key, *(h.server_key for h in config.bridge.hosts)]
        assert keys and all(k and k.startswith("/etc/lipsync/keys/") for k in keys), keys
        assert config.metrics.host == "0.0.0.0" and config.metrics.port


def _stages(path: Path) -> list[list[str]]:
    """The container file's instructions (continuations joined), split into build stages."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    stages: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_the_container_files_make_small_non_root_images(image):
    stages = _stages(IMAGES[image])
    assert len(stages) == 2, "a build stage and a final stage"
    final = stages[-1]
    user = next(ln for ln in reversed(final) if ln.upper().startswith("USER "))
    assert re.fullmatch(r"USER [1-9]\d*(:[1-9]\d*)?", user), "a numeric non-root user (runAsNonRoot checks it)"
    assert any(ln.startswith("COPY --from=build /opt/venv /opt/venv") for ln in final)
    run = " ".join(ln for ln in final if ln.upper().startswith("RUN "))
    assert not re.search(r"\b(gcc|g\+\+|build-essential|python3-dev|pip install)\b", run), run
    assert 'ENTRYPOINT ["python", "-m", "supervisor"]' in final, "the supervisor is PID 1 (SIGTERM drains)"
    exposed = {int(p) for ln in final if ln.startswith("EXPOSE ") for p in ln.split()[1:]}
    assert {5555, 5570, 9108, 8080} <= exposed
    build = " ".join(stages[0])
    assert f'"/src[{image}]"' in build, "the image installs its own extra"


def test_both_images_build_on_the_same_python_base():
    """The GPU image's CUDA libraries come from the gpu extra's wheels, not a CUDA base (docs/deploy.md)."""
    bases = {name: [ln for ln in path.read_text().splitlines() if ln.startswith(("ARG ", "FROM "))]
             for name, path in IMAGES.items()}
    assert bases["cpu"] == bases["gpu"], bases


@pytest.mark.slow
def test_the_package_the_images_install_serves_outside_the_source_tree(tmp_path):
    """What `pip install /src[cpu]` puts in an image: the wheel alone (config/default.yaml and the
    viewer's page inside it), run from another directory, serves a request and the viewer page."""
    import sys
    import urllib.request

    import numpy as np

    from lipsync_client import Session
    from tests.helpers import base_config, free_port, make_avatar, run_server

    # Built from what the container files COPY, in a directory of its own: a build in the checkout
    # would leave build/ there, whose stale modules a later wheel would carry.
    src, wheels, site = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    for line in (ln for ln in IMAGES["cpu"].read_text().splitlines() if ln.startswith("COPY ") and "--from" not in ln):
        *sources, _ = line.split()[1:]
        for source in sources:
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, src / source, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                src.mkdir(exist_ok=True)
                shutil.copy(ROOT / source, src / source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(src)],
                   check=True, capture_output=True, timeout=600)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    *map(str, wheels.glob("*.whl"))], check=True, capture_output=True, timeout=600)
    env = {"PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import frontend, config; print(frontend.__file__)"], cwd=tmp_path,
                           env={**__import__("os").environ, **env}, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(site)), where.stdout
    make_avatar(tmp_path / "models", "a", n_frames=3)
    cfg = base_config(tmp_path / "models", viewer={"port": free_port()})
    with run_server(tmp_path, cfg, env=env, cwd=tmp_path) as srv:
        with srv.client() as c:
            header, frames = c.composite("a", np.zeros((2, 32, 16, 16), np.float32))
        assert header["batch"] == 2 and len(frames) == 2
        with Session(srv.endpoint, "a", format="h264", webrtc=True) as s:
            with urllib.request.urlopen(s.info["viewer_url"], timeout=10) as page:
                assert b"<video" in page.read()
