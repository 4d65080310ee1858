"""Property: whatever the sequence of binds (any node, any shape, with or without a
prioritize holding a node first) and pod deletions, no GPU is ever over-committed, and an
extender rebuilt from the annotations alone holds exactly what the running one holds."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k8s_bridge.extender.models import ExtenderArgs, ExtenderBindingArgs
from k8s_bridge.extender.service import Extender, ExtenderConfig
from k8s_bridge.kube import Kube
from tests.fakes.apiserver import FakeApiserver
from tests.k8s.helpers import NAMES, gpu, gpu_usage, pod_object, publish_node

SHAPES = [(10, 1), (20, 2), (25, 4), (30, 8), (50, 4), (60, 10), (100, None), (200, None)]
NODES = ["n0", "n1"]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("bind"), st.sampled_from(SHAPES), st.sampled_from(NODES)),
        st.tuples(st.just("prio+bind"), st.sampled_from(SHAPES), st.sampled_from(NODES)),
        st.tuples(st.just("delete"), st.integers(0, 50), st.just("")),
    ),
    min_size=5,
    max_size=30,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, policy=st.sampled_from(["binpack", "spread", "frag"]))
def test_no_overcommit_and_rebuild_matches(ops, policy: str) -> None:
    with FakeApiserver() as srv:
        for n in NODES:
            publish_node(srv, n, [gpu(n, 0), gpu(n, 1, 24)])
        caps = {g.uuid: g for n in NODES for g in (gpu(n, 0), gpu(n, 1, 24))}
        ext = Extender(Kube(srv.client(), NAMES), ExtenderConfig(node_policy=policy, watch=False))
        ext.start()
        bound: list[str] = []
        for i, (op, arg, node) in enumerate(ops):
            if op in ("bind", "prio+bind"):
                name = f"p{i}"
                pod = srv.store.create("pods", pod_object(name, [arg]))
                if op == "prio+bind":  # prioritize holds its best node; bind may pick another
                    ext.prioritize(ExtenderArgs(Pod=pod, NodeNames=NODES))
                args = ExtenderBindingArgs(
                    PodName=name, PodNamespace="default", PodUID=pod["metadata"]["uid"], Node=node
                )
                err = ext.bind(args).error
                placed = srv.store.get("pods", "default", name)["spec"].get("nodeName")
                assert (err == "") == (placed == node), err
                if not err:
                    bound.append(name)
            elif bound:
                name = bound.pop(arg % len(bound))
                uid = srv.store.delete("pods", "default", name)["metadata"]["uid"]
                ext.state.release_pod(uid)  # what the pod watch does on DELETED
            ext.state.state.check_invariants()
            for u, row in gpu_usage(srv).items():
                cap = caps[u]
                assert row["core"] <= 100 and row["memory"] <= cap.memory_gib
                assert row["slices"] <= cap.max_slices()
        assert not ext.state.assumed  # every prioritized pod was bound or refused
        fresh = Extender(Kube(srv.client(), NAMES), ExtenderConfig(watch=False))
        fresh.start()
        a, b = ext.state.state, fresh.state.state
        assert np.array_equal(a.free_core, b.free_core)
        assert np.array_equal(a.free_mem, b.free_mem)
        assert np.array_equal(a.slices, b.slices)
