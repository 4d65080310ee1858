"""helm/qgpu rendered by Helm's engine, linted, and every object schema-checked.

What is real here: Helm's Go library (helm-python-sdk) renders and lints the chart,
values.schema.json is enforced by it, every object is validated against the Kubernetes
OpenAPI schemas of several versions (kubernetes-validate, strict), each qgpu container's
command is parsed by the real `qgpu` argument parser (and the agent's by its config model),
the extender verbs are the extender app's routes, the webhook's matchConditions are
evaluated by a CEL engine against the same pods `k8s_bridge` classifies, and the generated
certificate is checked with `cryptography`.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from kubernetes.utils import parse_quantity

from qgpu.model import DEFAULT_PLACEMENT, IsolationPolicy
from tests.helm.chart import (
    KUBE_VERSIONS,
    Obj,
    Rendered,
    command,
    containers,
    flags,
    helm_python,
    render,
    validate_all,
)

cel = pytest.importorskip("cel", reason="needs common-expression-language (dev extra)")

PREFIX = "tke.cloud.tencent.com"


@pytest.fixture(scope="module")
def default() -> Rendered:
    return render()


# --- lint and schemas --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kube_version", "values"),
    [
        ("1.28.0", {}),
        ("1.30.0", {}),
        ("1.34.0", {}),
        ("1.30.0", {"webhook": {"certManager": {"enabled": True}}}),
        ("1.30.0", {"webhook": {"enabled": False}, "manager": {"agent": {"enabled": False}}}),
    ],
)
def test_lint_strict_has_no_errors_or_warnings(kube_version: str, values: dict[str, Any]) -> None:
    from tests.helm.chart import CHART

    result = helm_python.lint(str(CHART), values, strict=True, kube_version=kube_version)
    assert result["errors"] == []
    # severity 1 is INFO (only "icon is recommended"); 2 WARNING, 3 ERROR
    assert [m for m in result["messages"] if m["severity"] > 1] == []


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(
    default: Rendered, version: str
) -> None:
    assert validate_all(default.objects, version) == []


def test_default_objects_are_named_as_tke_names_them(default: Rendered) -> None:
    assert default.kinds() == sorted(
        [
            ("ClusterRole", "qgpu-manager"),
            ("ClusterRole", "qgpu-scheduler"),
            ("ClusterRoleBinding", "qgpu-manager"),
            ("ClusterRoleBinding", "qgpu-scheduler"),
            ("ClusterRoleBinding", "qgpu-scheduler-kube-scheduler"),
            ("ClusterRoleBinding", "qgpu-scheduler-volume-scheduler"),
            ("ConfigMap", "qgpu-scheduler-config"),
            ("DaemonSet", "qgpu-manager"),
            ("Deployment", "qgpu-scheduler"),
            ("MutatingWebhookConfiguration", "qgpu-scheduler"),
            ("Role", "qgpu-scheduler-leader-election"),
            ("RoleBinding", "qgpu-scheduler-auth-reader"),
            ("RoleBinding", "qgpu-scheduler-leader-election"),
            ("Secret", "qgpu-assignment-key"),
            ("Secret", "qgpu-scheduler-extender-tls"),
            ("Secret", "qgpu-scheduler-webhook-tls"),
            ("Service", "qgpu-manager-metrics"),
            ("Service", "qgpu-scheduler"),
            ("ServiceAccount", "qgpu-manager"),
            ("ServiceAccount", "qgpu-scheduler"),
        ]
    )
    for o in default.objects:
        if o["kind"] not in ("ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration"):
            assert o["metadata"]["namespace"] == "kube-system", o["metadata"]


@pytest.mark.parametrize(
    "values",
    [
        {"policies": {"placement": "best"}},
        {"policies": {"isolation": "strict"}},
        {"manager": {"gpuBackend": "cuda"}},
        {"webhook": {"failurePolicy": "Maybe"}},
        {"scheduler": {"extender": {"httpTimeout": "30"}}},
        {"resourcePrefix": "Not A Domain"},
        {"scheduler": {"replicas": 0}},
        {"unknownKey": 1},
        {"assignmentSigning": {"existingSecret": "Not_A_Name"}},
        {"assignmentSigning": {"enabled": "yes"}},
        {"manager": {"agent": {"watchdogUnowned": "ignore"}}},
    ],
)
def test_values_schema_refuses_bad_values(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmError):
        render(values)


# --- qgpu-manager ------------------------------------------------------------------------


def _parse_qgpu(argv: list[str]) -> Any:
    from qgpu.cli import build_parser

    assert argv[0] == "qgpu"
    return build_parser().parse_args(argv[1:])  # SystemExit(2) on an unknown flag or choice


def test_manager_daemonset_shape(default: Rendered) -> None:
    ds = default.manager
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"qgpu-device-enable": "enable"}
    assert spec["hostPID"] is True
    assert spec["serviceAccountName"] == "qgpu-manager"
    assert set(containers(ds)) == {"agent", "device-plugin"}
    assert list(containers(ds, init=True)) == ["install-interposer", "label-node"]
    for c in containers(ds).values():
        assert c["securityContext"]["privileged"] is True
        assert c["image"] == "qgpu/qgpu:0.1.0"
    requests = [c["resources"]["requests"] for c in containers(ds).values()]
    assert sum(parse_quantity(r["memory"]) for r in requests) == parse_quantity("300M")
    assert sum(parse_quantity(r["cpu"]) for r in requests) == parse_quantity("0.2")


def test_manager_commands_parse_with_the_real_cli(default: Rendered) -> None:
    from enforcement.agent.cli import config_from_args

    cs = containers(default.manager)
    agent = _parse_qgpu(command(cs["agent"]))
    cfg = config_from_args(agent)  # the agent's pydantic settings: values and rules
    assert str(cfg.state_dir) == "/var/lib/qgpu"
    assert str(cfg.socket) == "/var/lib/qgpu/agent.sock"
    assert cfg.node_name == "<NODE_NAME>"  # $(NODE_NAME) from the downward API
    assert (cfg.watchdog_kill, cfg.watchdog_unowned) == ("all", "kill")  # the agent's own
    plugin = _parse_qgpu(command(cs["device-plugin"]))
    assert plugin.command == "device-plugin"
    assert plugin.prefix == PREFIX
    assert plugin.agent_socket == str(cfg.socket)
    assert plugin.hook_library == str(cfg.hook_path) == "/usr/local/qgpu/lib/libqgpu_hook.so"
    assert plugin.state_dir == str(cfg.state_dir)
    assert plugin.plugin_dir == "/var/lib/kubelet/device-plugins"
    for c in cs.values():
        names = {e["name"] for e in c["env"]}
        assert "NODE_NAME" in names
        node_env = next(e for e in c["env"] if e["name"] == "NODE_NAME")
        assert node_env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_processes_of_no_slice_can_be_left_to_report(default: Rendered) -> None:
    from enforcement.agent.cli import config_from_args

    values = {"manager": {"agent": {"watchdogUnowned": "report"}}}
    agent = containers(render(values).manager)["agent"]
    assert config_from_args(_parse_qgpu(command(agent))).watchdog_unowned == "report"


def _mounts(workload: Obj, container: Obj) -> dict[str, tuple[str, str | None]]:
    """mountPath -> (volume name, hostPath of the volume or None)."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    out = {}
    for m in container.get("volumeMounts") or []:
        assert m["name"] in volumes, f"{container['name']} mounts undefined volume {m['name']}"
        host = volumes[m["name"]].get("hostPath", {}).get("path")
        out[m["mountPath"]] = (m["name"], host)
    return out


def test_manager_host_paths_are_mounted_at_their_host_paths(default: Rendered) -> None:
    """Allocate hands kubelet HOST paths (limits files, ledgers, the interposer): each path a
    container writes or names must be the same inside and on the host."""
    ds = default.manager
    cs = containers(ds)
    agent, plugin = flags(cs["agent"]), flags(cs["device-plugin"])
    for c, paths in (
        (cs["agent"], [agent["state-dir"], "/usr/local/qgpu/lib", "/var/lib/kubelet/pods"]),
        (
            cs["device-plugin"],
            [
                plugin["state-dir"],
                "/usr/local/qgpu/lib",
                plugin["plugin-dir"],
                str(Path(plugin["pod-resources-socket"]).parent),  # kubelet's pod-resources
            ],
        ),
        (containers(ds, init=True)["install-interposer"], ["/usr/local/qgpu/lib"]),
    ):
        mounts = _mounts(ds, c)
        for p in paths:
            assert p in mounts, (c["name"], p, mounts)
            assert mounts[p][1] == p, (c["name"], p, mounts[p])
    assert str(agent["hook-path"]).startswith("/usr/local/qgpu/lib/")


def test_install_interposer_init_container_installs_the_built_hook(
    default: Rendered, tmp_path: Any
) -> None:
    import os
    import subprocess
    import sys

    from enforcement import native

    built = native.hook_library_path()  # built by `make`/pip install: missing is a failure
    init = containers(default.manager, init=True)["install-interposer"]
    argv = command(init)
    assert argv[:2] == ["python", "-c"]
    target = tmp_path / "usr-local-qgpu-lib"
    env = {**os.environ, "QGPU_INTERPOSER_DIR": str(target)}
    for _ in range(2):  # the init container runs again on every pod restart
        subprocess.run([sys.executable, *argv[1:]], env=env, check=True)
    installed = target / "libqgpu_hook.so"
    assert installed.read_bytes() == built.read_bytes()
    assert installed.stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in target.iterdir()) == ["libqgpu_hook.so"]


def test_label_node_init_container_sets_the_default_isolation_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The init container's exact script, run against the fake apiserver (in this process)."""
    from tests.fakes.apiserver import FakeApiserver

    init = containers(render({"policies": {"isolation": "fs"}}).manager, init=True)["label-node"]
    argv = command(init)
    assert argv[:2] == ["python", "-c"]
    code = compile(argv[2], "label-node", "exec")
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    assert env["QGPU_DEFAULT_ISOLATION"] == "fs"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    label = f"{PREFIX}/qgpu-schedule-policy"
    srv = FakeApiserver().start()
    try:
        monkeypatch.setenv("QGPU_APISERVER", srv.url)
        srv.store.create("nodes", {"metadata": {"name": "gpu-a", "labels": {"x": "y"}}})
        srv.store.create("nodes", {"metadata": {"name": "gpu-b", "labels": {label: "bs"}}})
        for node in ("gpu-a", "gpu-b", "gpu-a"):  # it runs again on every pod restart
            monkeypatch.setenv("NODE_NAME", node)
            exec(code, {"__name__": "__main__"})
        a = srv.store.get("nodes", "", "gpu-a")["metadata"]["labels"]
        b = srv.store.get("nodes", "", "gpu-b")["metadata"]["labels"]
    finally:
        srv.stop()
    assert a == {"x": "y", label: "fixed-share"}
    assert b == {label: "bs"}  # a label set by hand wins


def test_manager_rbac_covers_what_the_device_plugin_does(default: Rendered) -> None:
    rules = default.get("ClusterRole", "qgpu-manager")["rules"]
    allowed = {(r, v) for rule in rules for r in rule["resources"] for v in rule["verbs"]}
    assert {("nodes", "get"), ("nodes", "patch")} <= allowed
    assert {("pods", "get"), ("pods", "list"), ("pods", "patch")} <= allowed
    binding = default.get("ClusterRoleBinding", "qgpu-manager")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "qgpu-manager", "namespace": "kube-system"}
    ]


# --- qgpu-scheduler ----------------------------------------------------------------------


def test_scheduler_configuration_registers_the_extender(default: Rendered) -> None:
    from k8s_bridge.extender.app import create_app
    from tests.helm.scheduler_config import KubeSchedulerConfiguration

    cfg = KubeSchedulerConfiguration.model_validate(default.scheduler_config())
    assert [p.scheduler_name for p in cfg.profiles] == ["qgpu-scheduler"]
    (ext,) = cfg.extenders
    assert ext.node_cache_capable is True
    assert ext.weight == 10
    assert [(m.name, m.ignored_by_scheduler) for m in ext.managed_resources] == [
        (f"{PREFIX}/qgpu-core", False),
        (f"{PREFIX}/qgpu-memory", False),
    ]
    routes = {r.path for r in create_app(None).routes}  # type: ignore[arg-type]
    for verb in (ext.filter_verb, ext.prioritize_verb, ext.bind_verb):
        assert f"/{verb}" in routes
    extender = _parse_qgpu(command(containers(default.scheduler)["extender"]))
    assert ext.url_prefix == f"https://127.0.0.1:{extender.port}"
    # authentication is on by default: kube-scheduler presents the chart's client
    # certificate, the extender accepts only that CA and that common name
    assert ext.enable_https is True and ext.tls_config is not None
    client_mount = next(
        m
        for m in containers(default.scheduler)["kube-scheduler"]["volumeMounts"]
        if m["name"] == "extender-client"
    )["mountPath"]
    assert ext.tls_config.cert_file == f"{client_mount}/client.crt"
    assert ext.tls_config.ca_file == f"{client_mount}/ca.crt"
    assert extender.client_ca and extender.tls_cert and extender.client_name == ["qgpu-scheduler"]
    off = render({"scheduler": {"extender": {"auth": {"enabled": False}}}})
    (plain,) = off.scheduler_config()["extenders"]
    assert plain["urlPrefix"].startswith("http://") and "tlsConfig" not in plain
    assert off.find("Secret", "qgpu-scheduler-extender-tls") is None
    # no --placement: the extender's default is qgpu's one default placement
    assert "--placement" not in " ".join(command(containers(default.scheduler)["extender"]))
    assert extender.placement == DEFAULT_PLACEMENT.value
    assert extender.gpu_placement is None
    assert cfg.leader_election.leader_elect is True
    assert cfg.leader_election.resource_name == "qgpu-scheduler"
    assert cfg.leader_election.resource_namespace == "kube-system"


def test_scheduler_deployment_shape(default: Rendered) -> None:
    dep = default.scheduler
    assert dep["spec"]["replicas"] == 1
    cs = containers(dep)
    assert set(cs) == {"kube-scheduler", "extender", "webhook"}
    assert cs["kube-scheduler"]["image"].startswith("registry.k8s.io/kube-scheduler:v1.")
    assert command(cs["kube-scheduler"])[:2] == [
        "kube-scheduler",
        "--config=/etc/qgpu-scheduler/config.yaml",
    ]
    mount = next(m for m in cs["kube-scheduler"]["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == "/etc/qgpu-scheduler"
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == "qgpu-scheduler-config"
    requests = [c["resources"]["requests"] for c in cs.values()]
    assert sum(parse_quantity(r["memory"]) for r in requests) == parse_quantity("800M")
    assert sum(parse_quantity(r["cpu"]) for r in requests) == parse_quantity("1")
    webhook = _parse_qgpu(command(cs["webhook"]))
    assert (webhook.prefix, webhook.scheduler_name) == (PREFIX, "qgpu-scheduler")
    secret_mount = next(m for m in cs["webhook"]["volumeMounts"] if m["name"] == "webhook-tls")
    assert webhook.tls_cert == f"{secret_mount['mountPath']}/tls.crt"
    assert webhook.tls_key == f"{secret_mount['mountPath']}/tls.key"


def test_scheduler_rbac(default: Rendered) -> None:
    rules = default.get("ClusterRole", "qgpu-scheduler")["rules"]
    allowed = {(r, v) for rule in rules for r in rule["resources"] for v in rule["verbs"]}
    for res in ("pods", "nodes"):
        assert {(res, v) for v in ("get", "list", "watch", "patch")} <= allowed
    assert ("pods/binding", "create") in allowed
    assert ("events", "create") in allowed
    lease = default.get("Role", "qgpu-scheduler-leader-election")
    named = next(r for r in lease["rules"] if r.get("resourceNames"))
    assert named["resourceNames"] == ["qgpu-scheduler"]
    refs = {
        b["roleRef"]["name"]
        for b in default.of_kind("ClusterRoleBinding")
        if b["subjects"][0]["name"] == "qgpu-scheduler"
    }
    assert refs == {"qgpu-scheduler", "system:kube-scheduler", "system:volume-scheduler"}


def test_scheduler_config_change_rolls_the_pods(default: Rendered) -> None:
    frag = render({"policies": {"placement": "frag"}, "scheduler": {"extender": {"weight": 3}}})
    key = "checksum/config"
    before = default.scheduler["spec"]["template"]["metadata"]["annotations"][key]
    after = frag.scheduler["spec"]["template"]["metadata"]["annotations"][key]
    assert before != after


# --- the webhook -------------------------------------------------------------------------


def _webhook(r: Rendered) -> Obj:
    (hook,) = r.get("MutatingWebhookConfiguration", "qgpu-scheduler")["webhooks"]
    return hook


def test_webhook_certificate_is_a_working_chain(default: Rendered) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import rsa

    hook = _webhook(default)
    secret = default.get("Secret", "qgpu-scheduler-webhook-tls")
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert base64.b64decode(hook["clientConfig"]["caBundle"]) == data["ca.crt"]
    ca = x509.load_pem_x509_certificate(data["ca.crt"])
    cert = x509.load_pem_x509_certificate(data["tls.crt"])
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    svc = hook["clientConfig"]["service"]
    assert f"{svc['name']}.{svc['namespace']}.svc" in sans.get_values_for_type(x509.DNSName)
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key = load_pem_private_key(data["tls.key"], password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    service = default.get("Service", svc["name"])
    port = next(p for p in service["spec"]["ports"] if p["port"] == svc["port"])
    assert port["targetPort"] == "webhook"
    assert svc["path"] == "/mutate"


def _pod(limits: dict[str, Any] | None = None, init: dict[str, Any] | None = None) -> Obj:
    spec: Obj = {"containers": [{"name": "main", "image": "busybox"}]}
    if limits is not None:
        spec["containers"][0]["resources"] = {"limits": limits}
    if init is not None:
        spec["initContainers"] = [{"name": "init", "image": "busybox", "resources": init}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


@pytest.mark.parametrize(
    "pod",
    [
        _pod({f"{PREFIX}/qgpu-core": 30, f"{PREFIX}/qgpu-memory": 8}),
        _pod({f"{PREFIX}/qgpu-memory": 8}),
        _pod({"cpu": "1"}),
        _pod(),
        _pod({"example.com/qgpu-core": 30}),
        _pod(None, init={"requests": {f"{PREFIX}/qgpu-core": 30}}),
        _pod({"nvidia.com/gpu": 1}, init={"limits": {"memory": "1Gi"}}),
    ],
)
def test_webhook_match_condition_selects_exactly_the_pods_k8s_bridge_calls_qgpu(
    default: Rendered, pod: Obj
) -> None:
    """The CEL matchCondition (evaluated by a CEL engine) agrees with `asks_for_qgpu`."""
    from k8s_bridge.resources import Names, asks_for_qgpu

    (cond,) = _webhook(default)["matchConditions"]
    assert cel.evaluate(cond["expression"], {"object": pod}) is asks_for_qgpu(Names(PREFIX), pod)


# --- values toggles ----------------------------------------------------------------------


def test_prefix_changes_every_resource_name() -> None:
    r = render({"resourcePrefix": "gpu.example.com"})
    ext = r.scheduler_config()["extenders"][0]
    assert [m["name"] for m in ext["managedResources"]] == [
        "gpu.example.com/qgpu-core",
        "gpu.example.com/qgpu-memory",
    ]
    assert flags(containers(r.manager)["device-plugin"])["prefix"] == "gpu.example.com"
    for name in ("extender", "webhook"):
        assert flags(containers(r.scheduler)[name])["prefix"] == "gpu.example.com"
    label_env = {
        e["name"]: e.get("value") for e in containers(r.manager, init=True)["label-node"]["env"]
    }
    assert label_env["QGPU_RESOURCE_PREFIX"] == "gpu.example.com"
    hook = _webhook(r)
    assert hook["name"] == "qgpu-scheduler.gpu.example.com"
    pod = _pod({"gpu.example.com/qgpu-core": 30, "gpu.example.com/qgpu-memory": 4})
    assert cel.evaluate(hook["matchConditions"][0]["expression"], {"object": pod}) is True
    old = _pod({f"{PREFIX}/qgpu-core": 30, f"{PREFIX}/qgpu-memory": 4})
    assert cel.evaluate(hook["matchConditions"][0]["expression"], {"object": old}) is False
    assert validate_all(r.objects, "1.30") == []


@pytest.mark.parametrize(
    ("placement", "gpu_placement", "isolation"),
    [("spread", "", "fixed-share"), ("frag", "binpack", "bs")],
)
def test_policies(placement: str, gpu_placement: str, isolation: str) -> None:
    r = render(
        {
            "policies": {
                "placement": placement,
                "gpuPlacement": gpu_placement,
                "isolation": isolation,
            }
        }
    )
    ext = _parse_qgpu(command(containers(r.scheduler)["extender"]))
    assert ext.placement == placement
    assert ext.gpu_placement == (gpu_placement or None)
    agent = _parse_qgpu(command(containers(r.manager)["agent"]))
    assert (agent.placement, agent.gpu_placement) == (placement, gpu_placement or None)
    assert IsolationPolicy.parse(agent.isolation) is IsolationPolicy.parse(isolation)
    label = containers(r.manager, init=True)["label-node"]
    assert {"name": "QGPU_DEFAULT_ISOLATION", "value": isolation} in label["env"]


def test_node_selector_tolerations_and_images() -> None:
    tolerations = [{"key": "gpu", "operator": "Equal", "value": "yes", "effect": "NoExecute"}]
    r = render(
        {
            "manager": {"nodeSelector": {"pool": "gpu-a100"}, "tolerations": tolerations},
            "scheduler": {
                "nodeSelector": {"role": "system"},
                "kubeScheduler": {"image": {"tag": "v1.33.2"}},
            },
            "image": {"repository": "registry.example.com/qgpu", "tag": "1.2.3"},
            "imagePullSecrets": [{"name": "registry"}],
        }
    )
    ds = r.manager["spec"]["template"]["spec"]
    # Helm merges maps with the defaults; a null value drops a default key
    assert ds["nodeSelector"] == {"pool": "gpu-a100", "qgpu-device-enable": "enable"}
    only = render({"manager": {"nodeSelector": {"pool": "gpu-a100", "qgpu-device-enable": None}}})
    assert only.manager["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu-a100"}
    assert ds["tolerations"] == tolerations
    assert ds["imagePullSecrets"] == [{"name": "registry"}]
    assert r.scheduler["spec"]["template"]["spec"]["nodeSelector"] == {"role": "system"}
    images = [
        c["image"]
        for w in (r.manager, r.scheduler)
        for init in (False, True)
        for c in containers(w, init=init).values()
    ]
    assert sorted(set(images)) == [
        "registry.example.com/qgpu:1.2.3",
        "registry.k8s.io/kube-scheduler:v1.33.2",
    ]
    assert validate_all(r.objects, "1.33") == []


def test_cert_manager_replaces_the_generated_certificate() -> None:
    r = render({"webhook": {"certManager": {"enabled": True}}})
    assert r.find("Secret", "qgpu-scheduler-webhook-tls") is None
    mwc = r.get("MutatingWebhookConfiguration", "qgpu-scheduler")
    assert mwc["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "kube-system/qgpu-scheduler-webhook"
    }
    assert "caBundle" not in _webhook(r)["clientConfig"]
    cert = r.get("Certificate", "qgpu-scheduler-webhook")
    issuer = r.get("Issuer", "qgpu-scheduler-selfsigned")
    assert cert["apiVersion"] == issuer["apiVersion"] == "cert-manager.io/v1"
    assert cert["spec"]["secretName"] == "qgpu-scheduler-webhook-tls"
    assert "qgpu-scheduler.kube-system.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"] == {"kind": "Issuer", "name": issuer["metadata"]["name"]}
    assert issuer["spec"] == {"selfSigned": {}}
    assert validate_all(r.objects, "1.30") == ["Issuer", "Certificate"]

    own = render(
        {
            "webhook": {
                "certManager": {
                    "enabled": True,
                    "issuerRef": {"kind": "ClusterIssuer", "name": "ca"},
                }
            }
        }
    )
    assert own.find("Issuer", "qgpu-scheduler-selfsigned") is None
    cert = own.get("Certificate", "qgpu-scheduler-webhook")
    assert cert["spec"]["issuerRef"] == {"kind": "ClusterIssuer", "name": "ca"}


def test_webhook_off_removes_every_webhook_piece() -> None:
    r = render({"webhook": {"enabled": False}})
    assert r.of_kind("MutatingWebhookConfiguration") == []
    assert sorted(s["metadata"]["name"] for s in r.of_kind("Secret")) == [
        "qgpu-assignment-key",
        "qgpu-scheduler-extender-tls",
    ]
    assert set(containers(r.scheduler)) == {"kube-scheduler", "extender"}
    volumes = [v["name"] for v in r.scheduler["spec"]["template"]["spec"]["volumes"]]
    assert volumes == ["config", "extender-client", "extender-server", "assignment-key"]
    ports = [p["name"] for p in r.get("Service", "qgpu-scheduler")["spec"]["ports"]]
    assert ports == ["extender"]
    assert "set schedulerName: qgpu-scheduler in the pods yourself" in r.notes
    assert validate_all(r.objects, "1.30") == []


def test_agent_off_lets_the_device_plugin_write_the_limits() -> None:
    r = render({"manager": {"agent": {"enabled": False}}})
    cs = containers(r.manager)
    assert set(cs) == {"device-plugin"}
    plugin = _parse_qgpu(command(cs["device-plugin"]))
    assert plugin.agent_socket is None
    volumes = [v["name"] for v in r.manager["spec"]["template"]["spec"]["volumes"]]
    assert "kubelet-pods" not in volumes
    assert validate_all(r.objects, "1.30") == []


def test_pod_resources_api_is_mounted_read_only_into_the_device_plugin_only(
    default: Rendered,
) -> None:
    """kubelet's pod-resources directory reaches the device plugin (read-only, its socket at
    the path the flag names) and no other container; turning the check off removes the
    mount and says so on the command line (the plugin refuses to start without either)."""
    cs = containers(default.manager)
    plugin = _parse_qgpu(command(cs["device-plugin"]))
    assert plugin.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert not plugin.no_pod_resources_check
    (mount,) = [m for m in cs["device-plugin"]["volumeMounts"] if m["name"] == "pod-resources"]
    assert (mount["mountPath"], mount["readOnly"]) == ("/var/lib/kubelet/pod-resources", True)
    for c in (cs["agent"], *containers(default.manager, init=True).values()):
        assert "pod-resources" not in {m["name"] for m in c.get("volumeMounts") or []}
    off = render(
        {"manager": {"devicePlugin": {"podResourcesCheck": False}, "podResourcesDir": "/x/pr"}}
    )
    plugin = _parse_qgpu(command(containers(off.manager)["device-plugin"]))
    assert plugin.no_pod_resources_check and plugin.pod_resources_socket is None
    volumes = [v["name"] for v in off.manager["spec"]["template"]["spec"]["volumes"]]
    assert "pod-resources" not in volumes
    moved = render({"manager": {"podResourcesDir": "/srv/kubelet/pod-resources"}})
    plugin = _parse_qgpu(command(containers(moved.manager)["device-plugin"]))
    assert plugin.pod_resources_socket == "/srv/kubelet/pod-resources/kubelet.sock"


def test_simulated_gpus_reach_both_manager_containers() -> None:
    r = render({"manager": {"gpuBackend": "sim", "simulatedGpus": "2xH100-80GB"}})
    for c in containers(r.manager).values():
        parsed = _parse_qgpu(command(c))
        assert (parsed.backend, parsed.sim) == ("sim", "2xH100-80GB")


def test_leader_election_off_and_replicas() -> None:
    r = render({"scheduler": {"leaderElection": False, "replicas": 2}})
    assert r.find("Role", "qgpu-scheduler-leader-election") is None
    assert r.scheduler_config()["leaderElection"]["leaderElect"] is False
    assert r.scheduler["spec"]["replicas"] == 2


def test_namespace_follows_the_release_when_unset() -> None:
    r = render({"namespace": ""}, namespace="gpu-system")
    for o in r.objects:
        if "namespace" in o["metadata"] and o["kind"] != "RoleBinding":
            assert o["metadata"]["namespace"] == "gpu-system", o["metadata"]
    auth = r.get("RoleBinding", "qgpu-scheduler-auth-reader")
    assert auth["metadata"]["namespace"] == "kube-system"  # where the apiserver's config lives
    assert auth["subjects"][0]["namespace"] == "gpu-system"
    assert _webhook(r)["clientConfig"]["service"]["namespace"] == "gpu-system"
    assert r.scheduler_config()["leaderElection"]["resourceNamespace"] == "gpu-system"


def test_external_extender_url_and_failure_policy() -> None:
    url = "http://qgpu-scheduler.kube-system.svc:8888"
    r = render(
        {"scheduler": {"extender": {"urlPrefix": url}}, "webhook": {"failurePolicy": "Ignore"}}
    )
    assert r.scheduler_config()["extenders"][0]["urlPrefix"] == url
    assert _webhook(r)["failurePolicy"] == "Ignore"


def test_every_value_is_documented_and_in_the_schema() -> None:
    """Each key of values.yaml has its own comment line right above it, and the schema
    (additionalProperties false, every key required) knows exactly these keys."""
    import json
    import re

    from tests.helm.chart import CHART

    schema = json.loads((CHART / "values.schema.json").read_text())
    structured: dict[str, dict[str, Any]] = {"": schema}  # path -> schema node with properties
    known: set[str] = set()

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, sub in (node.get("properties") or {}).items():
            path = prefix + k
            known.add(path)
            if "required" in sub:  # a group of values (resources, issuerRef: map values)
                structured[path] = sub
                walk(sub, path + ".")

    walk(schema, "")
    for path, node in structured.items():
        # global is shared with parent charts: other keys may be in it
        assert node.get("additionalProperties") is (None if path == "global" else False), path
        assert set(node["required"]) == set(node["properties"]) - {"global"}, path

    lines = (CHART / "values.yaml").read_text().splitlines()
    found: set[str] = set()
    stack: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][\w-]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = ".".join(s for _, s in stack)
        stack.append((indent, m.group(2)))
        if parent not in structured:
            continue  # inside a map or list value (a default selector, toleration, quantity)
        path = f"{parent}.{m.group(2)}" if parent else m.group(2)
        assert path in known, f"values.yaml: {path} is not in values.schema.json"
        assert lines[i - 1].strip().startswith("#"), f"values.yaml: {path} has no comment"
        found.add(path)
    assert found == known


# --- signed assignments ------------------------------------------------------------------


def _key_users(r: Rendered, secret: str) -> dict[str, list[str]]:
    """container name -> its command, for every container that mounts `secret`."""
    out = {}
    for workload in (r.manager, r.scheduler):
        spec = workload["spec"]["template"]["spec"]
        vols = {
            v["name"]
            for v in spec.get("volumes", [])
            if (v.get("secret") or {}).get("secretName") == secret
        }
        for c in spec["containers"] + spec.get("initContainers", []):
            if any(m["name"] in vols for m in c.get("volumeMounts", [])):
                out[c["name"]] = c["command"]
    return out


def test_assignment_key_reaches_the_extender_and_the_device_plugin_only(
    default: Rendered, tmp_path
) -> None:
    from k8s_bridge.assignment_mac import MIN_KEY_BYTES, AssignmentKeys

    secret = default.get("Secret", "qgpu-assignment-key")
    key = base64.b64decode(secret["data"]["key"])
    assert len(key) >= MIN_KEY_BYTES and set(secret["data"]) == {"key"}
    users = _key_users(default, "qgpu-assignment-key")
    assert set(users) == {"device-plugin", "extender"}  # not kube-scheduler, webhook, agent
    (tmp_path / "key").write_bytes(key)
    for name, argv in users.items():
        args = _parse_qgpu(argv)
        assert args.assignment_key_file == "/etc/qgpu-assignment-key/key", name
        assert args.assignment_previous_key_file == "/etc/qgpu-assignment-key/previous", name
        # the mounted Secret is what the command loads (no `previous`: no rotation)
        keys = AssignmentKeys.from_files(tmp_path / "key", tmp_path / "previous")
        assert keys == AssignmentKeys(key)
    # every install generates its own key
    assert render().get("Secret", "qgpu-assignment-key")["data"]["key"] != secret["data"]["key"]


def test_assignment_signing_off_or_from_an_existing_secret() -> None:
    off = render({"assignmentSigning": {"enabled": False}})
    assert off.find("Secret", "qgpu-assignment-key") is None
    for workload in (off.manager, off.scheduler):
        text = str(workload)
        assert "assignment-key" not in text, workload["metadata"]["name"]
    mine = render({"assignmentSigning": {"existingSecret": "my-qgpu-key"}})
    assert mine.find("Secret", "qgpu-assignment-key") is None
    assert set(_key_users(mine, "my-qgpu-key")) == {"device-plugin", "extender"}
    assert validate_all(mine.objects, "1.30") == []
