"""helm/qgpu's operator knobs (issue 20), rendered by Helm's engine: names and namespaces,
images and registries, pod metadata and security, extra flags and environment, update
strategies, the metrics Service and Prometheus Operator monitors, compat mode and the
slices-per-GPU policy.

Every combination is linted strictly and its objects validated against the Kubernetes
schemas; qgpu's commands are parsed by the real CLI; the compat matchCondition is evaluated
by a CEL engine against what `k8s_bridge` translates; label-node's exact script runs against
the fake apiserver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cel
import pytest

from tests.helm.chart import (
    CHART,
    Obj,
    Rendered,
    command,
    containers,
    flags,
    helm_python,
    render,
    validate_all,
)

PREFIX = "tke.cloud.tencent.com"

EVERYTHING: dict[str, Any] = {
    "nameOverride": "gpushare",
    "fullnameOverride": "team-gpu",
    "namespaceOverride": "gpu-system",
    "global": {"imageRegistry": "mirror.example.com"},
    "image": {"registry": "registry.example.com", "tag": "1.2.3"},
    "imagePullSecrets": [{"name": "pull"}],
    "manager": {
        "image": {"tag": "1.2.4", "pullPolicy": "Always"},
        "podLabels": {"team": "ml"},
        "podAnnotations": {"example.com/a": "b"},
        "podSecurityContext": {"fsGroup": 0},
        "updateStrategy": {"type": "OnDelete"},
        "slicesPerGpu": 8,
        "agent": {
            "extraArgs": ["--real-libcuda=/usr/lib64/libcuda.so.1"],
            "extraEnv": [{"name": "TZ", "value": "UTC"}],
        },
        "devicePlugin": {"extraArgs": ["--health-interval=5"], "extraEnv": [{"name": "A"}]},
    },
    "scheduler": {
        "image": {"repository": "other/qgpu"},
        "podLabels": {"team": "platform"},
        "podAnnotations": {"example.com/c": "d"},
        "updateStrategy": {"type": "Recreate"},
        "kubeScheduler": {"extraArgs": ["--v=4"], "extraEnv": [{"name": "GOGC", "value": "50"}]},
        "extender": {"extraArgs": ["--lock-ttl=60"], "extraEnv": [{"name": "B", "value": "1"}]},
    },
    "webhook": {"extraArgs": ["--log-level=DEBUG"], "extraEnv": [{"name": "C", "value": "2"}]},
    "metrics": {
        "port": 9500,
        "serviceMonitor": {
            "enabled": True,
            "labels": {"release": "kube-prometheus-stack"},
            "interval": "30s",
            "scrapeTimeout": "10s",
            "relabelings": [{"targetLabel": "cluster", "replacement": "a"}],
        },
        "podMonitor": {"enabled": True, "interval": "1m"},
    },
    "compat": {"enabled": True},
}

# each documented combination: lint-clean, schema-valid, consistent references
COMBINATIONS: list[dict[str, Any]] = [
    {},
    EVERYTHING,
    {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}},
    {"metrics": {"podMonitor": {"enabled": True}}, "webhook": {"enabled": False}},
    {"manager": {"agent": {"enabled": False}}, "metrics": {"serviceMonitor": {"enabled": True}}},
    {"compat": {"enabled": True}, "webhook": {"certManager": {"enabled": True}}},
    {"manager": {"slicesPerGpu": "16"}, "nameOverride": "x"},
]


def _qgpu(argv: list[str]) -> Any:
    from qgpu.cli import build_parser

    assert argv[0] == "qgpu"
    return build_parser().parse_args(argv[1:])  # SystemExit(2) on an unknown flag


def _pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def _pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _check_references(r: Rendered) -> None:
    """What one object names, another object of the render is (or a documented external)."""
    ns = r.manager["metadata"]["namespace"]
    workloads = [r.manager, r.scheduler]
    accounts = {o["metadata"]["name"] for o in r.of_kind("ServiceAccount")}
    for w in workloads:
        assert w["metadata"]["namespace"] == ns
        assert _selects(w["spec"]["selector"]["matchLabels"], _pod_labels(w))
        assert _pod_spec(w)["serviceAccountName"] in accounts
    for binding in r.of_kind("ClusterRoleBinding") + r.of_kind("RoleBinding"):
        for subject in binding["subjects"]:
            if subject["kind"] == "ServiceAccount":
                assert (subject["name"], subject["namespace"]) in {(a, ns) for a in accounts}
    ports_of = {
        id(w): {p["name"]: p for c in containers(w).values() for p in c.get("ports") or []}
        for w in workloads
    }
    services = r.of_kind("Service")
    for svc in services:
        (w,) = [w for w in workloads if _selects(svc["spec"]["selector"], _pod_labels(w))]
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports_of[id(w)], (svc["metadata"]["name"], port)
    for hook in r.of_kind("MutatingWebhookConfiguration"):
        ref = hook["webhooks"][0]["clientConfig"].get("service")
        svc = r.get("Service", ref["name"])
        assert ref["namespace"] == ns
        assert ref["port"] in [p["port"] for p in svc["spec"]["ports"]]
    for mon in r.of_kind("ServiceMonitor"):
        selected = [
            s
            for s in services
            if _selects(mon["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        names = {p["name"] for s in selected for p in s["spec"]["ports"]}
        for ep in mon["spec"]["endpoints"]:
            assert ep["port"] in names, ep
            _check_tls(r, ep)
    for mon in r.of_kind("PodMonitor"):
        selected = [
            w for w in workloads if _selects(mon["spec"]["selector"]["matchLabels"], _pod_labels(w))
        ]
        names = {n for w in selected for n in ports_of[id(w)]}
        for ep in mon["spec"]["podMetricsEndpoints"]:
            assert ep["port"] in names, ep
            _check_tls(r, ep)


def _check_tls(r: Rendered, ep: Obj) -> None:
    if ep["scheme"] != "https":
        return
    secret = ep["tlsConfig"]["ca"]["secret"]
    svc = r.get("Service", r.scheduler["metadata"]["name"])
    ns = svc["metadata"]["namespace"]
    assert ep["tlsConfig"]["serverName"] == f"{svc['metadata']['name']}.{ns}.svc"
    if r.find("Secret", secret["name"]) is None:  # cert-manager writes it
        cert = r.of_kind("Certificate")[0]
        assert cert["spec"]["secretName"] == secret["name"]
        assert ep["tlsConfig"]["serverName"] in cert["spec"]["dnsNames"]
    else:
        assert secret["key"] in r.get("Secret", secret["name"])["data"]


@pytest.mark.parametrize("values", COMBINATIONS, ids=range(len(COMBINATIONS)))
def test_helm_knob_combinations_lint_validate_and_reference_what_exists(
    values: dict[str, Any],
) -> None:
    result = helm_python.lint(str(CHART), values, strict=True, kube_version="1.30.0")
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] > 1] == []
    r = render(values, name="qgpu", namespace="ops")
    skipped = validate_all(r.objects, "1.30")
    assert set(skipped) <= {"Issuer", "Certificate", "ServiceMonitor", "PodMonitor"}
    _check_references(r)
    cs = containers(r.manager)
    for c in [*cs.values(), *containers(r.scheduler).values()]:
        if c["name"] != "kube-scheduler":
            _qgpu(command(c))


# --- names and namespaces ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "release", "base", "app"),
    [
        ({}, "qgpu", "qgpu", "qgpu"),
        ({}, "qgpu-prod", "qgpu-prod", "qgpu"),
        ({}, "prod", "prod-qgpu", "qgpu"),
        ({"nameOverride": "gpushare"}, "prod", "prod-gpushare", "gpushare"),
        ({"fullnameOverride": "team-gpu"}, "prod", "team-gpu", "qgpu"),
    ],
)
def test_helm_object_names_follow_the_release_and_overrides(
    values: dict[str, Any], release: str, base: str, app: str
) -> None:
    r = render(values, name=release)
    assert r.find("DaemonSet", f"{base}-manager") is not None, r.kinds()
    assert r.find("Deployment", f"{base}-scheduler") is not None
    assert r.find("Service", f"{base}-manager-metrics") is not None
    assert r.find("Secret", f"{base}-scheduler-webhook-tls") is not None
    for o in r.objects:
        assert o["metadata"]["name"].startswith(base), o["metadata"]["name"]
        assert o["metadata"]["labels"]["app.kubernetes.io/name"] == app
    _check_references(r)


def test_helm_namespace_override_wins() -> None:
    r = render({"namespaceOverride": "gpu-system"}, namespace="default")
    spaced = {
        o["metadata"]["name"]: o["metadata"]["namespace"]
        for o in r.objects
        if "namespace" in o["metadata"]
    }
    # reading kube-system's extension-apiserver-authentication can only be granted there
    assert spaced.pop("qgpu-scheduler-auth-reader") == "kube-system"
    assert set(spaced.values()) == {"gpu-system"}
    assert render({"namespace": ""}, namespace="rel").manager["metadata"]["namespace"] == "rel"


# --- images ------------------------------------------------------------------------------


def _images(r: Rendered) -> dict[str, str]:
    return {
        c["name"]: c["image"]
        for w in (r.manager, r.scheduler)
        for init in (False, True)
        for c in containers(w, init=init).values()
    }


def test_helm_images_per_component_and_global_registry() -> None:
    r = render(
        {
            "image": {"registry": "registry.example.com", "tag": "1.2.3"},
            "manager": {"image": {"tag": "1.2.4", "pullPolicy": "Always"}},
            "scheduler": {"image": {"repository": "other/qgpu"}},
        }
    )
    images = _images(r)
    for name in ("install-interposer", "label-node", "agent", "device-plugin"):
        assert images[name] == "registry.example.com/qgpu/qgpu:1.2.4", name
    for name in ("extender", "webhook"):
        assert images[name] == "registry.example.com/other/qgpu:1.2.3"
    assert images["kube-scheduler"] == "registry.k8s.io/kube-scheduler:v1.30.14"
    assert {c["imagePullPolicy"] for c in containers(r.manager).values()} == {"Always"}
    assert containers(r.scheduler)["extender"]["imagePullPolicy"] == "IfNotPresent"

    mirrored = _images(render({"global": {"imageRegistry": "mirror.example.com"}}))
    assert set(mirrored.values()) == {
        "mirror.example.com/qgpu/qgpu:0.1.0",
        "mirror.example.com/kube-scheduler:v1.30.14",
    }


# --- pod metadata, security, extra flags, strategies -------------------------------------


def test_helm_pod_metadata_security_extra_args_env_and_strategies() -> None:
    r = render(EVERYTHING)
    ds, dep = r.manager, r.scheduler
    assert _pod_labels(ds)["team"] == "ml" and _pod_labels(dep)["team"] == "platform"
    assert ds["spec"]["template"]["metadata"]["annotations"] == {"example.com/a": "b"}
    dep_ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert dep_ann["example.com/c"] == "d" and "checksum/config" in dep_ann
    assert _pod_spec(ds)["securityContext"] == {"fsGroup": 0}
    assert _pod_spec(dep)["securityContext"]["runAsNonRoot"] is True  # default kept (merged)
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert "strategy" not in render().scheduler["spec"]
    assert _pod_spec(ds)["imagePullSecrets"] == [{"name": "pull"}]

    mc, sc = containers(ds), containers(dep)
    agent = _qgpu(command(mc["agent"]))
    assert agent.real_libcuda == "/usr/lib64/libcuda.so.1"
    assert _qgpu(command(mc["device-plugin"])).health_interval == 5.0  # the last flag wins
    assert _qgpu(command(sc["extender"])).lock_ttl == 60.0
    assert _qgpu(command(sc["webhook"])).log_level == "debug"  # any case, read as lower
    assert command(sc["kube-scheduler"])[-1] == "--v=4"
    assert {"name": "TZ", "value": "UTC"} in mc["agent"]["env"]
    assert {"name": "A"} in mc["device-plugin"]["env"]
    assert sc["kube-scheduler"]["env"] == [{"name": "GOGC", "value": "50"}]
    assert sc["extender"]["env"] == [{"name": "B", "value": "1"}]
    assert sc["webhook"]["env"] == [{"name": "C", "value": "2"}]


@pytest.mark.parametrize(
    "values",
    [
        {"nameOverride": "Bad_Name"},
        {"fullnameOverride": "x" * 51},
        {"namespaceOverride": "Not A Namespace"},
        {"global": {"imageRegistry": 5}},
        {"image": {"registry": 1}},
        {"manager": {"image": {"pullPolicy": "Sometimes"}}},
        {"manager": {"slicesPerGpu": 17}},
        {"manager": {"slicesPerGpu": "0"}},
        {"manager": {"slicesPerGpu": "floor"}},
        {"manager": {"podLabels": {"a": 1}}},
        {"manager": {"updateStrategy": {"type": "Recreate"}}},
        {"manager": {"agent": {"extraArgs": [1]}}},
        {"webhook": {"extraEnv": [{"value": "no name"}]}},
        {"metrics": {"port": 0}},
        {"metrics": {"serviceMonitor": {"interval": "30"}}},
        {"metrics": {"podMonitor": {"unknown": True}}},
        {"compat": {"enabled": "yes"}},
    ],
)
def test_helm_schema_refuses_bad_knobs(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmError):
        render(values)


# --- metrics -----------------------------------------------------------------------------


def test_helm_metrics_port_service_and_monitors() -> None:
    r = render(EVERYTHING)
    agent = containers(r.manager)["agent"]
    assert flags(agent)["metrics-port"] == "9500"
    assert agent["ports"] == [{"name": "metrics", "containerPort": 9500, "protocol": "TCP"}]
    svc = r.get("Service", "team-gpu-manager-metrics")
    assert svc["spec"]["clusterIP"] == "None"  # one endpoint per node's agent
    (mon,) = r.of_kind("ServiceMonitor")
    assert mon["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert mon["spec"]["namespaceSelector"] == {"matchNames": ["gpu-system"]}
    eps = {ep["port"]: ep for ep in mon["spec"]["endpoints"]}
    assert set(eps) == {"metrics", "extender", "webhook"}
    assert {ep["path"] for ep in eps.values()} == {"/metrics"}
    assert {ep["interval"] for ep in eps.values()} == {"30s"}
    assert eps["webhook"]["scheme"] == "https" and eps["metrics"]["scheme"] == "http"
    assert eps["extender"]["relabelings"] == [{"targetLabel": "cluster", "replacement": "a"}]
    (pm,) = r.of_kind("PodMonitor")
    assert {ep["port"] for ep in pm["spec"]["podMetricsEndpoints"]} == set(eps)

    off = render({"metrics": {"enabled": False}})
    assert "metrics-port" not in flags(containers(off.manager)["agent"])
    assert "ports" not in containers(off.manager)["agent"]
    assert off.find("Service", "qgpu-manager-metrics") is None
    assert render().of_kind("ServiceMonitor") == [] and render().of_kind("PodMonitor") == []


# --- compat mode -------------------------------------------------------------------------


def _pod(limits: dict[str, Any], annotations: dict[str, str] | None = None) -> Obj:
    return {
        "metadata": {"annotations": annotations or {}},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


COMPAT_PODS = [
    _pod({f"{PREFIX}/qgpu-core": 30, f"{PREFIX}/qgpu-memory": 8}),
    _pod({f"{PREFIX}/qgpu-core": 30, f"{PREFIX}/qgpu-memory-percentage": 50}),
    _pod({"nvidia.com/gpu": 1, "nvidia.com/gpucores": 30, "nvidia.com/gpumem": 3000}),
    _pod({"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 25, "nvidia.com/gpucores": 5}),
    _pod({"koordinator.sh/gpu-core": 50, "koordinator.sh/gpu-memory-ratio": 50}),
    _pod({"koordinator.sh/gpu": 100}),
    _pod({"koordinator.sh/gpu-memory": "8Gi"}),
    _pod({"nvidia.com/gpu": 1}),  # plain NVIDIA: never qgpu's
    _pod({"cpu": "1"}, {"hami.io/node-scheduler-policy": "binpack"}),
]


@pytest.mark.parametrize("compat", [False, True])
@pytest.mark.parametrize("pod", COMPAT_PODS, ids=range(len(COMPAT_PODS)))
def test_compat_match_condition_sends_exactly_the_pods_the_webhook_acts_on(
    compat: bool, pod: Obj
) -> None:
    """CEL (evaluated by a CEL engine) agrees with `asks_for_qgpu` and, in compat mode,
    with `compat.foreign_in` — the pods whose names the webhook translates."""
    from k8s_bridge import compat as compat_names
    from k8s_bridge.resources import Names, asks_for_qgpu

    r = render({"compat": {"enabled": compat}})
    (hook,) = r.get("MutatingWebhookConfiguration", "qgpu-scheduler")["webhooks"]
    (cond,) = hook["matchConditions"]
    want = asks_for_qgpu(Names(PREFIX), pod) or (compat and bool(compat_names.foreign_in(pod)))
    assert cel.evaluate(cond["expression"], {"object": pod}) is want


def test_compat_chart_names_are_k8s_bridges_and_flags_reach_both_components() -> None:
    import re

    from k8s_bridge import compat as compat_names

    r = render({"compat": {"enabled": True}})
    (hook,) = r.get("MutatingWebhookConfiguration", "qgpu-scheduler")["webhooks"]
    listed = re.findall(r"'([^']+)'", hook["matchConditions"][0]["expression"])
    foreign = {n for n in listed if not n.startswith(PREFIX)}
    assert foreign == set(compat_names.FOREIGN_RESOURCES)
    cs = containers(r.scheduler)
    assert _qgpu(command(cs["extender"])).compat is True
    assert _qgpu(command(cs["webhook"])).compat is True
    off = containers(render().scheduler)
    assert _qgpu(command(off["extender"])).compat is False
    assert _qgpu(command(off["webhook"])).compat is False


# --- slices per GPU ----------------------------------------------------------------------


def test_helm_slices_per_gpu_reaches_both_manager_containers() -> None:
    from enforcement.agent.cli import config_from_args
    from enforcement.discovery import node_slice_policy

    cs = containers(render({"manager": {"slicesPerGpu": 8}}).manager)
    agent = config_from_args(_qgpu(command(cs["agent"])))
    plugin = _qgpu(command(cs["device-plugin"]))
    assert plugin.slices_per_gpu == "8"
    assert plugin.slices_per_gpu_file == "/var/lib/qgpu/slices-per-gpu"
    # no node label (no file): the chart's value
    assert (agent.slice_policy.limit, agent.slice_policy.fixed) == (8, True)
    # floor-gib keeps maxSlicesPerGpu as its cap
    cs = containers(render({"manager": {"maxSlicesPerGpu": 5}}).manager)
    plugin = _qgpu(command(cs["device-plugin"]))
    policy = node_slice_policy(plugin.slices_per_gpu, None, plugin.max_slices)
    assert (policy.limit, policy.fixed) == (5, False)
    agent = config_from_args(_qgpu(command(cs["agent"])))
    assert (agent.slice_policy.limit, agent.slice_policy.fixed) == (5, False)


def test_label_node_writes_the_slices_label_for_the_agent_and_refuses_a_bad_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from enforcement.discovery import node_slice_policy
    from tests.fakes.apiserver import FakeApiserver

    init = containers(render().manager, init=True)["label-node"]
    code = compile(command(init)[2], "label-node", "exec")
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    assert env["QGPU_SLICES_FILE"] == "/var/lib/qgpu/slices-per-gpu"
    assert {"name": "state", "mountPath": "/var/lib/qgpu"} in init["volumeMounts"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    target = tmp_path / "slices-per-gpu"
    monkeypatch.setenv("QGPU_SLICES_FILE", str(target))
    label = f"{PREFIX}/qgpu-slices-per-gpu"
    srv = FakeApiserver().start()
    try:
        monkeypatch.setenv("QGPU_APISERVER", srv.url)
        for name, value in (("fixed", "12"), ("floor", "floor-gib"), ("bad", "32")):
            srv.store.create("nodes", {"metadata": {"name": name, "labels": {label: value}}})
        srv.store.create("nodes", {"metadata": {"name": "plain", "labels": {}}})

        def run(node: str) -> None:
            monkeypatch.setenv("NODE_NAME", node)
            exec(code, {"__name__": "__main__"})

        run("fixed")
        policy = node_slice_policy("floor-gib", target)
        assert (policy.limit, policy.fixed) == (12, True)  # the label beats the chart
        run("floor")
        assert node_slice_policy("4", target, 16).fixed is False
        run("plain")
        assert not target.exists()  # no label: the chart's value again
        assert node_slice_policy("4", target).limit == 4
        with pytest.raises(SystemExit) as stop:
            run("bad")
        assert f"node label {label}='32'" in str(stop.value)
        assert not target.exists()  # nothing half-written
    finally:
        srv.stop()
