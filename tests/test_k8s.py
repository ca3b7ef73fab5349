"""Kubernetes manifests and Serve configs, offline: every manifest against the vendored KubeRay CRD schemas
(k8s/schemas/, plus a strict unknown-field pass like `kubectl --validate=strict`), serveConfigV2 == configs/serve.yaml,
both Serve configs through Serve's own ServeDeploySchema, and the family wiring between config and worker groups.

Run alone:  .venv/bin/python -m pytest tests/test_k8s.py -q
"""

from __future__ import annotations

import copy
import functools
import re
import warnings
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
SERVE_YAML = ROOT / "configs" / "serve.yaml"
LOCAL_YAML = ROOT / "configs" / "serve.local.yaml"
LEGACY = ("max_concurrent_queries", "target_num_ongoing_requests_per_replica", "num_replicas_per_node",
          "smoothing_factor", "RayServeHandle", "RayServeSyncHandle")


Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 1 MB each


@functools.cache
def crd_spec_schema(kind_file: str) -> dict:
    crd = yaml.load((K8S / "schemas" / kind_file).read_text(), Loader=Loader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]["properties"]["spec"]


def manifests() -> list[tuple[str, dict]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out = []
    for f in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / f).read_text()):
            if doc:
                out.append((f, doc))
    return out


def unknown_fields(obj, schema: dict, path: str = "spec") -> list[str]:
    """Keys the schema doesn't declare (the API server would silently prune them: typos go unnoticed)."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("x-kubernetes-int-or-string"):
        return []
    bad = []
    if isinstance(obj, dict) and "properties" in schema:
        for k, v in obj.items():
            if k in schema["properties"]:
                bad += unknown_fields(v, schema["properties"][k], f"{path}.{k}")
            elif "additionalProperties" not in schema:
                bad.append(f"{path}.{k}")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, v in obj.items():
            bad += unknown_fields(v, schema["additionalProperties"], f"{path}.{k}")
    elif isinstance(obj, list) and "items" in schema:
        for i, v in enumerate(obj):
            bad += unknown_fields(v, schema["items"], f"{path}[{i}]")
    return bad


def validate_spec(doc: dict, schema: dict) -> list[str]:
    v = jsonschema.Draft7Validator(schema)
    errs = [f"spec.{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc["spec"])]
    return errs + [f"{p}: unknown field" for p in unknown_fields(doc["spec"], schema)]


def rayservice() -> dict:
    (doc,) = [d for _, d in manifests() if d["kind"] == "RayService"]
    return doc


def serve_config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# ---- schema validation ----------------------------------------------------------------------------------------

def test_every_manifest_is_listed_and_known():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, "k8s/kustomization.yaml must list every manifest in k8s/"
    kinds = sorted(d["kind"] for _, d in manifests())
    assert kinds == ["Deployment", "RayService", "Service"]


def test_rayservice_matches_crd_schema():
    doc = rayservice()
    assert doc["apiVersion"] == "ray.io/v1"
    assert len(doc["metadata"]["name"]) <= 47  # KubeRay's MaxRayServiceNameLength
    assert validate_spec(doc, crd_spec_schema("ray.io_rayservices.yaml")) == []


def test_raycluster_part_matches_raycluster_crd():
    spec = rayservice()["spec"]["rayClusterConfig"]
    doc = {"spec": spec}
    assert validate_spec(doc, crd_spec_schema("ray.io_rayclusters.yaml")) == []


def test_validator_catches_mistakes():
    schema = crd_spec_schema("ray.io_rayservices.yaml")
    doc = copy.deepcopy(rayservice())
    del doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"]
    doc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] = "yes"
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}  # typo
    errs = "\n".join(validate_spec(doc, schema))
    assert "'maxReplicas' is a required property" in errs
    assert "'yes' is not of type 'boolean'" in errs
    assert "headGroupSpec.rayStartParam: unknown field" in errs


def test_redis_deployment_and_service():
    docs = {d["kind"]: d for _, d in manifests() if d["kind"] in ("Deployment", "Service")}
    dep, svc = docs["Deployment"], docs["Service"]
    assert dep["apiVersion"] == "apps/v1" and svc["apiVersion"] == "v1"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert svc["spec"]["ports"][0]["targetPort"] in port_names
    # the app reaches Redis through this Service
    url = serve_config(SERVE_YAML)["applications"][0]["args"]["redis_url"]
    host, port = re.match(r"redis://([^:/]+):(\d+)", url).groups()
    assert host == svc["metadata"]["name"] and int(port) == svc["spec"]["ports"][0]["port"]


# ---- serveConfigV2 and the Serve configs ----------------------------------------------------------------------

def test_serve_config_v2_is_configs_serve_yaml():
    assert rayservice()["spec"]["serveConfigV2"] == SERVE_YAML.read_text(), \
        "k8s/rayservice.yaml is out of date: run python scripts/sync_k8s.py"


@pytest.mark.parametrize("path", [SERVE_YAML, LOCAL_YAML], ids=["gpu", "local"])
def test_serve_deploy_schema_parses(path):
    ServeDeploySchema = pytest.importorskip("ray.serve.schema").ServeDeploySchema

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # e.g. look_back_period_s <= metrics_interval_s
        cfg = ServeDeploySchema.model_validate(serve_config(path))
    (app,) = cfg.applications
    assert app.import_path == "rankserve.deployments.app:build_app"
    assert cfg.grpc_options.grpc_servicer_functions == [
        "rankserve.proto.rankserve_pb2_grpc.add_GeneratorServicer_to_server"]


def test_servicer_function_imports():
    from rankserve.proto import rankserve_pb2_grpc

    assert callable(rankserve_pb2_grpc.add_GeneratorServicer_to_server)


@pytest.mark.parametrize("path, gpus", [(SERVE_YAML, 1), (LOCAL_YAML, 0)], ids=["gpu", "local"])
def test_one_worker_deployment_per_family(path, gpus):
    (app,) = serve_config(path)["applications"]
    families = app["args"]["families"]
    deps = {d["name"]: d for d in app["deployments"]}
    assert set(deps) == {"Router"} | {f"Worker-{f}" for f in families}
    for f in families:
        d = deps[f"Worker-{f}"]
        a = d["autoscaling_config"]
        assert 1 <= a["min_replicas"] < a["max_replicas"]
        assert a["target_ongoing_requests"] < d["max_ongoing_requests"]  # target = max = 1 misbehaves (ray #24793)
        assert d["ray_actor_options"]["num_gpus"] == gpus


def test_gpu_worker_groups_follow_families():
    """Each family's replicas ask for a custom resource that exactly one GPU worker group offers, with room for
    max_replicas one-GPU pods, so KubeRay's autoscaler scales the right group."""
    (app,) = serve_config(SERVE_YAML)["applications"]
    cluster = rayservice()["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["version"] == "v2"
    assert cluster["rayVersion"] == "2.60.0"
    groups = cluster["workerGroupSpecs"]
    for f in app["args"]["families"]:
        d = {d["name"]: d for d in app["deployments"]}[f"Worker-{f}"]
        (res,) = d["ray_actor_options"]["resources"]
        offering = [g for g in groups if res in g.get("resources", {})]
        assert len(offering) == 1, f"{res}: want exactly one worker group offering it"
        g = offering[0]
        (c,) = g["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == g["rayStartParams"]["num-gpus"] == "1"
        assert g["maxReplicas"] >= d["autoscaling_config"]["max_replicas"]
        assert g["minReplicas"] >= 0 and g["minReplicas"] <= g["maxReplicas"]


def test_ports_named_for_the_serve_service():
    cfg = serve_config(SERVE_YAML)
    (head,) = rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["serve"] == cfg["http_options"]["port"]
    assert ports["serve-grpc"] == cfg["grpc_options"]["port"]


def test_local_and_gpu_configs_have_the_same_shape():
    """The same families (PARSE included) and services, on the CPU locally and on GPUs in the cluster."""
    gpu, local = serve_config(SERVE_YAML), serve_config(LOCAL_YAML)
    ga, la = gpu["applications"][0], local["applications"][0]
    assert set(ga["args"]["families"]) == set(la["args"]["families"])
    assert set(ga["args"]) == set(la["args"])
    for f, fam in la["args"]["families"].items():
        assert fam["device"] == "cpu" and ga["args"]["families"][f]["device"] == "cuda"


def test_no_legacy_serve_names():
    files = [*ROOT.glob("configs/*.yaml"), *K8S.glob("*.yaml"), *ROOT.glob("deployments/*.py"), ROOT / "bench" / "load.py"]
    for p in files:
        if p.exists():
            text = p.read_text()
            for name in LEGACY:
                assert name not in text, f"{p.relative_to(ROOT)} uses the legacy Serve name {name}"
