"""The scheduler extender over HTTP: Go field names, filter reasons, scores, policies,
nodeCacheCapable and full-Nodes modes, rebuild after restart, and following the watches."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from k8s_bridge.extender.app import create_app
from k8s_bridge.extender.models import ExtenderBindingArgs, HostPriorityList
from k8s_bridge.extender.service import Extender, ExtenderConfig
from k8s_bridge.kube import Kube
from qgpu.model import GpuDevice, GpuHealth
from tests.fakes.apiserver import FakeApiserver
from tests.k8s.helpers import (
    NAMES,
    ServedApp,
    U,
    assignment_of,
    gpu,
    pod_object,
    publish_node,
    wait_until,
)


@pytest.fixture
def three(apiserver: FakeApiserver) -> FakeApiserver:
    for n in ("n0", "n1", "n2"):
        publish_node(apiserver, n, [gpu(n, 0), gpu(n, 1)])
    return apiserver


@pytest.fixture
def http_ext(three: FakeApiserver) -> Iterator[tuple[httpx.Client, Extender]]:
    ext = Extender(Kube(three.client(), NAMES), ExtenderConfig())
    ext.start()
    served = ServedApp(create_app(ext)).start()
    with httpx.Client(base_url=served.url, timeout=30) as client:
        yield client, ext
    served.stop()
    ext.stop()


def _bind(srv: FakeApiserver, ext: Extender, name: str, node: str) -> str:
    uid = srv.store.get("pods", "default", name)["metadata"]["uid"]
    args = ExtenderBindingArgs(PodName=name, PodNamespace="default", PodUID=uid, Node=node)
    return ext.bind(args).error


def test_filter_speaks_go_field_names(three, http_ext) -> None:
    http, _ = http_ext
    pod = three.store.create("pods", pod_object("p", [(30, 4)]))
    body = http.post("/filter", json={"Pod": pod, "NodeNames": ["n0", "n1", "nx"]}).json()
    assert set(body) >= {"NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert body["NodeNames"] == ["n0", "n1"]
    assert "no qgpu GPU inventory" in body["FailedAndUnresolvableNodes"]["nx"]
    assert body["Error"] == ""


def test_filter_with_full_node_objects_returns_nodes(three, http_ext) -> None:
    http, _ = http_ext
    pod = three.store.create("pods", pod_object("p", [(30, 4)]))
    nodes = {"items": [three.store.get("nodes", "", n) for n in ("n0", "n2")]}
    body = http.post("/filter", json={"Pod": pod, "Nodes": nodes}).json()
    assert [n["metadata"]["name"] for n in body["Nodes"]["items"]] == ["n0", "n2"]


def test_filter_reasons_name_the_rule_and_aggregate(three, http_ext) -> None:
    """A failing node's reason names the request and the rule it fails, in the same words
    for every node failing the same way (kube-scheduler's event counts equal reasons)."""
    http, ext = http_ext
    for name, node in (("big", "n0"), ("big2", "n0"), ("big3", "n1")):
        three.store.create("pods", pod_object(name, [(90, 15)]))
        assert _bind(three, ext, name, node) == ""
    pod = three.store.create("pods", pod_object("p", [(30, 4)]))
    body = http.post("/filter", json={"Pod": pod, "NodeNames": ["n0", "n1", "n2"]}).json()
    assert body["NodeNames"] == ["n1", "n2"]
    assert body["FailedNodes"] == {"n0": "qgpu: container c0: no GPU with qgpu-core=30 free"}
    # memory binds, not core
    low = three.store.create("pods", pod_object("m", [(10, 2)]))
    body = http.post("/filter", json={"Pod": low, "NodeNames": ["n0"]}).json()
    assert body["FailedNodes"]["n0"] == (
        "qgpu: container c0: no GPU with qgpu-core=10 and qgpu-memory=2 GiB free"
    )
    # whole GPUs: n0 and n1 both fail the same way, so the reasons are equal
    whole = three.store.create("pods", pod_object("w", [(200, None)]))
    body = http.post("/filter", json={"Pod": whole, "NodeNames": ["n0", "n1", "n2"]}).json()
    assert body["NodeNames"] == ["n2"]
    assert set(body["FailedNodes"].values()) == {"qgpu: container c0: fewer than 2 empty GPUs"}
    # after a release the node fits again
    three.store.delete("pods", "default", "big")
    wait_until(lambda: all(r.name != "big" for r in ext.state.pods.values()), what="release")
    body = http.post("/filter", json={"Pod": pod, "NodeNames": ["n0"]}).json()
    assert body["NodeNames"] == ["n0"]


def test_invalid_pod_is_unresolvable_everywhere_with_the_rule(three, http_ext) -> None:
    http, _ = http_ext
    pod = pod_object("p", [(30, 0)])
    body = http.post("/filter", json={"Pod": pod, "NodeNames": ["n0", "n1"]}).json()
    assert body["NodeNames"] == []
    assert set(body["FailedAndUnresolvableNodes"]) == {"n0", "n1"}
    assert "qgpu-memory" in body["FailedAndUnresolvableNodes"]["n0"]
    assert "GiB >= 1" in body["FailedAndUnresolvableNodes"]["n0"]


def test_pod_without_qgpu_passes_every_node(three, http_ext) -> None:
    http, _ = http_ext
    pod = pod_object("plain")
    body = http.post("/filter", json={"Pod": pod, "NodeNames": ["n0", "n1"]}).json()
    assert body["NodeNames"] == ["n0", "n1"]


def test_containers_must_fit_together(apiserver: FakeApiserver) -> None:
    publish_node(apiserver, "one", [gpu("one", 0)])
    publish_node(apiserver, "two", [gpu("two", 0), gpu("two", 1)])
    ext = Extender(Kube(apiserver.client(), NAMES), ExtenderConfig(watch=False))
    ext.start()
    from k8s_bridge.extender.models import ExtenderArgs

    pod = pod_object("p", [(60, 4), (60, 4)])
    res = ext.filter(ExtenderArgs(Pod=pod, NodeNames=["one", "two"]))
    assert res.node_names == ["two"]
    assert "do not fit together" in res.failed_nodes["one"]


def test_prioritize_scores_0_to_10_by_policy(three, http_ext) -> None:
    http, ext = http_ext
    three.store.create("pods", pod_object("a", [(50, 8)]))
    assert _bind(three, ext, "a", "n1") == ""
    pod = three.store.create("pods", pod_object("p", [(30, 4)]))
    args = {"Pod": pod, "NodeNames": ["n0", "n1", "n2"]}
    scores = {h["Host"]: h["Score"] for h in http.post("/prioritize", json=args).json()}
    assert scores == {"n0": 0, "n1": 10, "n2": 0}  # binpack: the used node first
    spread = pod_object("q", [(30, 4)], annotations={NAMES.placement_annotation: "spread"})
    args = {"Pod": three.store.create("pods", spread), "NodeNames": ["n0", "n1", "n2"]}
    scores = {h["Host"]: h["Score"] for h in http.post("/prioritize", json=args).json()}
    assert scores == {"n0": 10, "n1": 0, "n2": 10}


def test_whole_gpus_take_empty_cards_on_one_node(three, http_ext) -> None:
    _, ext = http_ext
    three.store.create("pods", pod_object("w", [(200, None)]))
    assert _bind(three, ext, "w", "n2") == ""
    ca = assignment_of(three, "w").containers["c0"]
    assert ca.gpus == [U("n2", 0), U("n2", 1)] and ca.core == 100
    assert ca.devices == {"core": {U("n2", 0): 100, U("n2", 1): 100}}
    three.store.create("pods", pod_object("s", [(10, 1)]))
    assert "cannot take" in _bind(three, ext, "s", "n2")


def test_restarted_extender_rebuilds_from_annotations(three, http_ext) -> None:
    _, ext = http_ext
    for i, node in enumerate(["n0", "n0", "n1", "n2"]):
        three.store.create("pods", pod_object(f"p{i}", [(20 + 10 * i, 2 + i)]))
        assert _bind(three, ext, f"p{i}", node) == ""
    fresh = Extender(Kube(three.client(), NAMES), ExtenderConfig(watch=False))
    fresh.start()
    old, new = ext.state.state, fresh.state.state
    assert np.array_equal(old.free_core, new.free_core)
    assert np.array_equal(old.free_mem, new.free_mem)
    assert np.array_equal(old.slices, new.slices)
    assert set(fresh.state.pods) == set(ext.state.pods)


def test_watch_releases_deleted_and_finished_pods(three, http_ext) -> None:
    _, ext = http_ext
    for n in ("a", "b"):
        three.store.create("pods", pod_object(n, [(40, 4)]))
        assert _bind(three, ext, n, "n0") == ""
    s = ext.state.state
    assert int(s.free_core[s.uuid_index[U("n0", 0)]]) == 20
    three.store.delete("pods", "default", "a")
    wait_until(lambda: int(s.free_core[s.uuid_index[U("n0", 0)]]) == 60, what="release")
    three.store.set_phase("default", "b", "Succeeded")
    wait_until(lambda: int(s.free_core[s.uuid_index[U("n0", 0)]]) == 100, what="release")
    assert not ext.state.pods


def test_watch_follows_node_inventory_and_health(three, http_ext) -> None:
    from k8s_bridge.protocol import PublishedInventory

    http, ext = http_ext
    publish_node(three, "n3", [gpu("n3", 0, 32)])
    wait_until(lambda: "n3" in ext.state.inventories, what="new node")
    sick = GpuDevice(
        uuid=U("n0", 0), index=0, model="T4", memory_mib=16 * 1024, health=GpuHealth.UNHEALTHY
    )
    inv = PublishedInventory(gpus=[sick, gpu("n0", 1)], max_slices_per_gpu=16, published_at=0)
    Kube(three.client(), NAMES).publish_node_annotations(
        "n0", {NAMES.inventory_annotation: inv.model_dump_json()}
    )
    wait_until(lambda: not ext.state.inventories["n0"].gpus[0].healthy, what="health")
    pod = three.store.create("pods", pod_object("p", [(100, None), (100, None)]))
    body = http.post("/filter", json={"Pod": pod, "NodeNames": ["n0", "n1"]}).json()
    assert body["NodeNames"] == ["n1"]
    assert "unhealthy" in body["FailedNodes"]["n0"]


def test_every_configured_policy_binds(apiserver: FakeApiserver) -> None:
    from qgpu.model import PlacementPolicy

    for n in ("n0", "n1"):
        publish_node(apiserver, n, [gpu(n, 0), gpu(n, 1)])
    for policy in PlacementPolicy:
        ext = Extender(
            Kube(apiserver.client(), NAMES), ExtenderConfig(node_policy=policy, watch=False)
        )
        ext.start()
        for i in range(3):
            name = f"{policy.value}-{i}"
            apiserver.store.create("pods", pod_object(name, [(20, 2)]))
            assert _bind(apiserver, ext, name, "n1") == "", policy
        ext.state.state.check_invariants()
        for i in range(3):
            apiserver.store.delete("pods", "default", f"{policy.value}-{i}")


def _ext(srv: FakeApiserver, **cfg) -> Extender:
    ext = Extender(Kube(srv.client(), NAMES), ExtenderConfig(watch=False, **cfg))
    ext.start()
    return ext


def test_prioritize_holds_the_best_node_until_bind(apiserver: FakeApiserver) -> None:
    """kube-scheduler binds asynchronously: the next pod's filter must already see the
    previous pod on the node prioritize ranked first."""
    from k8s_bridge.extender.models import ExtenderArgs

    publish_node(apiserver, "one", [gpu("one", 0)])
    ext = _ext(apiserver)
    a = apiserver.store.create("pods", pod_object("a", [(60, 4)]))
    b = apiserver.store.create("pods", pod_object("b", [(60, 4)]))
    assert ext.filter(ExtenderArgs(Pod=a, NodeNames=["one"])).node_names == ["one"]
    ext.prioritize(ExtenderArgs(Pod=a, NodeNames=["one"]))
    res = ext.filter(ExtenderArgs(Pod=b, NodeNames=["one"]))  # a's bind still in flight
    assert res.node_names == [] and "qgpu-core=60 free" in res.failed_nodes["one"]
    assert int(ext.state.state.free_core[0]) == 40  # a's GPUs are held
    assert _bind(apiserver, ext, "a", "one") == ""
    assert int(ext.state.state.free_core[0]) == 40  # the assumption became the assignment
    ext.state.state.check_invariants()


def test_a_hold_made_after_the_reply_is_seen_by_every_later_decision(
    apiserver: FakeApiserver,
) -> None:
    """Over HTTP prioritize leaves its hold for after the reply (`hold_after_reply`): a
    filter, a prioritize or a bind that comes first must still see it, and a pod filtered
    again competes without it."""
    from k8s_bridge.extender.models import ExtenderArgs

    publish_node(apiserver, "one", [gpu("one", 0)])
    ext = _ext(apiserver)
    s = ext.state.state
    a = apiserver.store.create("pods", pod_object("a", [(60, 4)]))
    b = apiserver.store.create("pods", pod_object("b", [(60, 4)]))
    only = ExtenderArgs(Pod=a, NodeNames=["one"])
    ext.prioritize_scores(only, hold_after_reply=True)
    assert not ext.state.assumed and int(s.free_core[0]) == 100  # not made yet
    res = ext.filter(ExtenderArgs(Pod=b, NodeNames=["one"]))  # comes before the settle
    assert res.node_names == [] and "qgpu-core=60 free" in res.failed_nodes["one"]
    assert set(ext.state.assumed) == {a["metadata"]["uid"]} and int(s.free_core[0]) == 40
    # the same pod filtered again: its old hold (made or pending) gives way
    ext.prioritize_scores(only, hold_after_reply=True)
    assert ext.filter(only).node_names == ["one"]
    assert not ext.state.assumed and int(s.free_core[0]) == 100
    # another pod's prioritize sees a pending hold too: b cannot be held beside it
    ext.prioritize_scores(only, hold_after_reply=True)
    ext.prioritize_scores(ExtenderArgs(Pod=b, NodeNames=["one"]), hold_after_reply=True)
    ext.state.settle()
    assert set(ext.state.assumed) == {a["metadata"]["uid"]}
    # a bind before the settle takes the pending hold as its assignment
    ext.prioritize_scores(only, hold_after_reply=True)
    assert _bind(apiserver, ext, "a", "one") == ""
    assert not ext.state.assumed and int(s.free_core[0]) == 40
    assert _bind(apiserver, ext, "b", "one") != ""  # no room left for b
    s.check_invariants()


def test_a_pending_hold_that_fails_does_not_fail_the_next_pods_filter(
    apiserver: FakeApiserver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from k8s_bridge.extender.models import ExtenderArgs

    publish_node(apiserver, "one", [gpu("one", 0)])
    ext = _ext(apiserver)
    a = apiserver.store.create("pods", pod_object("a", [(60, 4)]))
    b = apiserver.store.create("pods", pod_object("b", [(30, 4)]))
    ext.prioritize_scores(ExtenderArgs(Pod=a, NodeNames=["one"]), hold_after_reply=True)

    def broken(*_a: object, **_k: object) -> None:
        raise RuntimeError("placement engine bug")

    monkeypatch.setattr(ext.state, "_place", broken)
    res = ext.filter(ExtenderArgs(Pod=b, NodeNames=["one"]))
    assert res.node_names == ["one"] and not ext.state.assumed
    assert "bind will place it afresh" in caplog.text
    monkeypatch.undo()
    assert _bind(apiserver, ext, "a", "one") == ""  # bind places it without the hold
    assert int(ext.state.state.free_core[0]) == 40


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "fastapi-routes"])
def test_prioritize_over_http_holds_once_the_reply_has_left(
    apiserver: FakeApiserver, fast: bool
) -> None:
    publish_node(apiserver, "one", [gpu("one", 0)])
    ext = _ext(apiserver)
    pod = apiserver.store.create("pods", pod_object("a", [(60, 4)]))
    served = ServedApp(create_app(ext, fast_path=fast)).start()
    try:
        with httpx.Client(base_url=served.url, timeout=30) as http:
            reply = http.post("/prioritize", json={"Pod": pod, "NodeNames": ["one"]})
            assert reply.json() == [{"Host": "one", "Score": 10}]
            # nothing else is asked: the hold is made by the settle after the reply
            wait_until(lambda: pod["metadata"]["uid"] in ext.state.assumed, what="the hold")
    finally:
        served.stop()
    assert int(ext.state.state.free_core[0]) == 40


def test_an_assumption_expires_and_yields_to_the_bound_node(apiserver: FakeApiserver) -> None:
    from k8s_bridge.extender.models import ExtenderArgs

    for n in ("n0", "n1"):
        publish_node(apiserver, n, [gpu(n, 0)])
    ext = _ext(apiserver, assume_ttl_s=0.2)
    a = apiserver.store.create("pods", pod_object("a", [(60, 4)]))
    ext.prioritize(ExtenderArgs(Pod=a, NodeNames=["n0", "n1"]))  # holds n0
    s = ext.state.state
    assert int(s.free_core[s.uuid_index[U("n0", 0)]]) == 40
    assert _bind(apiserver, ext, "a", "n1") == ""  # the scheduler chose n1 after all
    assert int(s.free_core[s.uuid_index[U("n0", 0)]]) == 100
    assert assignment_of(apiserver, "a").node == "n1"
    b = apiserver.store.create("pods", pod_object("b", [(60, 4)]))
    ext.prioritize(ExtenderArgs(Pod=b, NodeNames=["n0"]))  # holds n0 for b...
    time.sleep(0.3)  # ...until it expires without a bind
    c = apiserver.store.create("pods", pod_object("c", [(60, 4)]))
    assert ext.filter(ExtenderArgs(Pod=c, NodeNames=["n0"])).node_names == ["n0"]
    s.check_invariants()


def test_scores_stay_in_range_when_a_policy_rules_a_node_out(apiserver: FakeApiserver) -> None:
    from k8s_bridge.extender.models import ExtenderArgs

    for n in ("n0", "n1", "n2"):
        publish_node(apiserver, n, [gpu(n, 0)])
    for policy in ("binpack", "spread", "frag"):
        ext = _ext(apiserver, node_policy=policy, assume_ttl_s=0)
        full = apiserver.store.create("pods", pod_object(f"full-{policy}", [(100, None)]))
        assert _bind(apiserver, ext, full["metadata"]["name"], "n0") == ""
        pod = apiserver.store.create("pods", pod_object(f"p-{policy}", [(30, 4)]))
        scores = ext.prioritize(ExtenderArgs(Pod=pod, NodeNames=["n0", "n1", "n2"]))
        assert all(0 <= h["Score"] <= 10 for h in scores), (policy, scores)
        assert max(h["Score"] for h in scores) == 10
        apiserver.store.delete("pods", "default", full["metadata"]["name"])


def test_fast_path_and_fastapi_routes_answer_alike(apiserver: FakeApiserver) -> None:
    """The verbs answered before FastAPI's routing give the bytes FastAPI's routes give,
    for good and bad input; the wire reply is a valid HostPriorityList."""
    for n in ("n0", "n1"):
        publish_node(apiserver, n, [gpu(n, 0)])
    ext = Extender(Kube(apiserver.client(), NAMES), ExtenderConfig(assume_ttl_s=0))
    ext.start()
    pod = apiserver.store.create("pods", pod_object("p", [(30, 4)]))
    args = {"Pod": pod, "NodeNames": ["n0", "n1", "nx"]}
    replies = []
    for fast in (True, False):
        served = ServedApp(create_app(ext, fast_path=fast)).start()
        try:
            with httpx.Client(base_url=served.url, timeout=30) as http:
                replies.append(
                    [
                        (r.status_code, r.headers["content-type"], r.content)
                        for r in (
                            http.post("/filter", json=args),
                            http.post("/prioritize", json=args),
                            http.post("/filter", content=b'{"Pod": 3}'),
                            http.post("/prioritize", content=b"not json"),
                            http.post("/bind", json={"PodName": "p"}),
                        )
                    ]
                )
                assert http.get("/healthz").json()["nodes"] == 2
        finally:
            served.stop()
    ext.stop()
    assert replies[0] == replies[1]
    (code, ctype, prio) = replies[0][1]
    assert code == 200 and ctype == "application/json"
    scores = HostPriorityList.validate_json(prio)
    assert [h["Host"] for h in scores] == ["n0", "n1", "nx"] and scores[2]["Score"] == 0
    assert [r[0] for r in replies[0][2:]] == [400, 400, 400]
    assert b"Pod=3" in replies[0][2][2]
    assert b"PodNamespace: this field is required" in replies[0][4][2]


def test_pod_events_carrying_the_held_assignment_change_nothing(apiserver: FakeApiserver) -> None:
    """Status updates of a bound pod (same assignment text) are skipped without parsing;
    a changed assignment or a finished phase is followed."""
    publish_node(apiserver, "n0", [gpu("n0", 0)])
    ext = Extender(Kube(apiserver.client(), NAMES), ExtenderConfig(watch=False))
    ext.start()
    apiserver.store.create("pods", pod_object("a", [(40, 4)]))
    assert _bind(apiserver, ext, "a", "n0") == ""
    obj = apiserver.store.get("pods", "default", "a")
    uid = obj["metadata"]["uid"]
    held = ext.state.pods[uid]
    assert held.assignment_text == obj["metadata"]["annotations"][NAMES.assignment_annotation]
    running = apiserver.store.set_phase("default", "a", "Running")
    ext.state.apply_pod(running)
    assert ext.state.pods[uid] is held  # the same record: nothing was re-applied
    assert held.resource_version == int(running["metadata"]["resourceVersion"])
    assert int(ext.state.state.free_core[0]) == 60
    ext.state.apply_pod(apiserver.store.set_phase("default", "a", "Succeeded"))
    assert uid not in ext.state.pods
    assert int(ext.state.state.free_core[0]) == 100
    ext.stop()


def test_host_priority_table_serializes_like_a_json_encoder() -> None:
    import json

    from k8s_bridge.extender.models import HostPriorityTable

    table = HostPriorityTable(["n0", 'we"ird'])
    names = ['we"ird', "n0", "stranger"]
    scores = np.array([10, 0, 3])
    wire = table.dumps(names, np.array([1, 0, -1]), scores)
    expected = [{"Host": n, "Score": int(v)} for n, v in zip(names, scores, strict=True)]
    assert json.loads(wire) == expected
    assert HostPriorityList.validate_json(wire) == expected
    assert table.dumps([], np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == b"[]"
    for bad in (11, -1):
        with pytest.raises(ValueError, match=f"scores must be 0..10, got .*{bad}"):
            table.dumps(["n0"], np.array([0]), np.array([bad]))
    with pytest.raises(ValueError, match="2 names, 1 positions and 1 scores"):
        table.dumps(["n0", "n0"], np.array([0]), np.array([1]))


def test_node_positions_are_remembered_per_node_set(apiserver: FakeApiserver) -> None:
    """The same name list gives the same read-only positions without a lookup per name;
    a new node set (a node published) starts afresh; odd names are looked up, not keyed."""
    for n in ("n0", "n1"):
        publish_node(apiserver, n, [gpu(n, 0)])
    ext = Extender(Kube(apiserver.client(), NAMES), ExtenderConfig())  # watching nodes
    ext.start()
    st = ext.state
    first = st._positions(["n1", "n0", "nx"])
    assert first.tolist() == [st.state.node_index["n1"], st.state.node_index["n0"], -1]
    assert st._positions(["n1", "n0", "nx"]) is first and not first.flags.writeable
    assert st._positions(["n1\nn0", "nx"]).tolist() == [-1, -1]  # not the memo of 3 names
    publish_node(apiserver, "n2", [gpu("n2", 0)])
    wait_until(lambda: "n2" in st.state.node_index)
    again = st._positions(["n1", "n0", "nx"])
    assert again is not first
    assert again.tolist() == [st.state.node_index["n1"], st.state.node_index["n0"], -1]
    assert st._positions(["n2"]).tolist() == [st.state.node_index["n2"]]
    ext.stop()


def test_the_request_mix_counts_each_pod_once(apiserver: FakeApiserver) -> None:
    """frag learns from the pods kube-scheduler brings: a pod filtered again and again,
    prioritized and bound still counts once."""
    from k8s_bridge.extender.models import ExtenderArgs

    for n in ("n0", "n1"):
        publish_node(apiserver, n, [gpu(n, 0), gpu(n, 1)])
    ext = _ext(apiserver, node_policy="frag")
    a = apiserver.store.create("pods", pod_object("a", [(30, 4)]))
    b = apiserver.store.create("pods", pod_object("b", [(50, 8)]))
    for _ in range(3):
        ext.filter(ExtenderArgs(Pod=a, NodeNames=["n0", "n1"]))
    ext.prioritize(ExtenderArgs(Pod=a, NodeNames=["n0", "n1"]))
    assert _bind(apiserver, ext, "a", "n1") == ""  # not the node prioritize held: placed again
    ext.filter(ExtenderArgs(Pod=b, NodeNames=["n0", "n1"]))
    mix = ext.state.engine.node_policy.mix()
    # each pod counts once, next to the default prior's whole-GPU arrivals
    from qgpu.mix_prior import DEFAULT_STRENGTH

    total = 2 + DEFAULT_STRENGTH
    shares = {core: share for (core, *_), share in mix.items()}
    assert shares == pytest.approx({30: 1 / total, 50: 1 / total, 100: DEFAULT_STRENGTH / total})
    ext.stop()
