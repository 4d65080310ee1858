"""Hostile input for the extender and the webhook over real HTTP (uvicorn with the bridge's
protocol, the fake apiserver behind the extender): hypothesis-generated bodies -- wrong
types, surrogates, huge integers, path tricks in names, nested junk -- and hand-picked
ones (10 MB, deep nesting, invalid JSON). No answer is ever >= 500; every 400 names the
field; the webhook's denials are AdmissionReviews with the request's uid."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k8s_bridge.extender.app import create_app as extender_app
from k8s_bridge.extender.service import Extender, ExtenderConfig
from k8s_bridge.kube import Kube
from k8s_bridge.webhook import create_app as webhook_app
from tests.fakes.apiserver import FakeApiserver
from tests.k8s.helpers import NAMES, ServedApp, gpu, pod_object, publish_node

NASTY_TEXT = st.sampled_from(
    ["\ud800", "..", "../..", "a/b", "%2F..", "?x=1", "kube-system", "", "x" * 300, "é", "\x00"]
)
NUMBERS = st.one_of(
    st.integers(),
    st.sampled_from([2**31, 2**63, -(2**63), 10**30, 10**4000, -1, 0, 99, 100, 150]),
    st.floats(allow_nan=False),
)
LEAF = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=12), NASTY_TEXT)
JUNK = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.one_of(st.text(max_size=6), NASTY_TEXT), inner, max_size=3),
    max_leaves=12,
)
AMOUNT = st.one_of(NUMBERS.map(str), NUMBERS, JUNK)
CONTAINER = st.fixed_dictionaries(
    {"name": st.one_of(st.text(max_size=8), JUNK)},
    optional={
        "resources": st.one_of(
            JUNK,
            st.fixed_dictionaries(
                {"limits": st.one_of(JUNK, st.fixed_dictionaries({NAMES.core: AMOUNT}))},
                optional={"requests": st.fixed_dictionaries({NAMES.memory: AMOUNT})},
            ),
        )
    },
)
POD = st.fixed_dictionaries(
    {
        "metadata": st.one_of(
            JUNK,
            st.fixed_dictionaries(
                {"name": st.one_of(NASTY_TEXT, JUNK)},
                optional={"namespace": NASTY_TEXT, "uid": JUNK, "annotations": JUNK},
            ),
        ),
        "spec": st.one_of(
            JUNK,
            st.fixed_dictionaries(
                {"containers": st.one_of(JUNK, st.lists(CONTAINER, max_size=3))},
                optional={"schedulerName": st.one_of(NASTY_TEXT, JUNK)},
            ),
        ),
    }
)
FILTER_BODY = st.one_of(
    JUNK,
    st.fixed_dictionaries(
        {"Pod": st.one_of(POD, JUNK)},
        optional={
            "NodeNames": st.one_of(JUNK, st.lists(st.one_of(NASTY_TEXT, st.just("n0")))),
            "Nodes": st.one_of(JUNK, st.fixed_dictionaries({"items": st.lists(JUNK)})),
        },
    ),
)
BIND_BODY = st.one_of(
    JUNK,
    st.fixed_dictionaries(
        {k: st.one_of(NASTY_TEXT, JUNK) for k in ("PodName", "PodNamespace", "PodUID", "Node")}
    ),
)
REVIEW_BODY = st.one_of(
    JUNK,
    st.fixed_dictionaries(
        {
            "request": st.one_of(
                JUNK,
                st.fixed_dictionaries(
                    {
                        "uid": st.one_of(st.text(max_size=10), JUNK),
                        "operation": st.one_of(st.sampled_from(["CREATE", "UPDATE"]), JUNK),
                        "object": st.one_of(POD, JUNK),
                    },
                    optional={"oldObject": st.one_of(POD, JUNK)},
                ),
            )
        },
        optional={"apiVersion": JUNK, "kind": JUNK},
    ),
)
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, httpx.Client]]:
    srv = FakeApiserver().start()
    for n in ("n0", "n1"):
        publish_node(srv, n, [gpu(n, 0), gpu(n, 1)])
    ext = Extender(Kube(srv.client(), NAMES), ExtenderConfig(watch=False))
    ext.start()
    served = [ServedApp(extender_app(ext)).start(), ServedApp(webhook_app(NAMES)).start()]
    clients = {
        "extender": httpx.Client(base_url=served[0].url, timeout=30),
        "webhook": httpx.Client(base_url=served[1].url, timeout=30),
    }
    try:
        yield clients
    finally:
        for c in clients.values():
            c.close()
        for s in served:
            s.stop()
        ext.stop()
        srv.stop()


def _post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    """POST `body` as JSON exactly as a hostile client may write it (lone surrogates
    escaped, integers of any size, non-finite floats as the bare words NaN/Infinity)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def _check_4xx(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code == 400:
        body = r.json()
        assert body["field"] and "rule" in body and len(r.text) < 2000, body


@FUZZ
@given(verb=st.sampled_from(["/filter", "/prioritize"]), body=FILTER_BODY)
def test_extender_filter_and_prioritize_never_fail(
    servers: dict[str, httpx.Client], verb: str, body: Any
) -> None:
    _check_4xx(_post(servers["extender"], verb, body))


@FUZZ
@given(body=BIND_BODY)
def test_extender_bind_never_fails_and_binds_nothing(
    servers: dict[str, httpx.Client], body: Any
) -> None:
    r = _post(servers["extender"], "/bind", body)
    _check_4xx(r)
    if r.status_code == 200:
        assert r.json()["Error"], r.text  # none of these pods exists: nothing is bound


@FUZZ
@given(body=REVIEW_BODY)
def test_webhook_never_fails(servers: dict[str, httpx.Client], body: Any) -> None:
    r = _post(servers["webhook"], "/mutate", body)
    _check_4xx(r)
    if r.status_code == 200:
        out = r.json()["response"]
        assert out["uid"] == body["request"]["uid"]
        if not out["allowed"]:
            assert out["status"]["message"].startswith("qgpu: "), out


HAND_PICKED = [
    b"{" * 100_000,
    b"[" * 100_000 + b"]" * 100_000,
    b'{"Pod": ' + b"1" * 5000 + b"}",
    b"\xff\xfe not utf-8",
    b'{"request": {"uid": "\\ud800", "object": {"spec": {"containers": "x"}}}}',
    b"NaN",
    b"",
    b"x" * (9 * 1024 * 1024),  # over the 8 MiB body limit
]


@pytest.mark.parametrize("raw", HAND_PICKED, ids=lambda b: f"{b[:12]!r}.{len(b)}")
@pytest.mark.parametrize("path", ["/filter", "/prioritize", "/bind", "/mutate"])
def test_hand_picked_bodies_are_4xx(
    servers: dict[str, httpx.Client], path: str, raw: bytes
) -> None:
    client = servers["webhook" if path == "/mutate" else "extender"]
    r = _post(client, path, raw)
    assert 400 <= r.status_code < 500 or (path == "/mutate" and r.status_code == 200), r.text
    _check_4xx(r)


# --- the webhook's rules ------------------------------------------------------------------


def _review(client: httpx.Client, pod: Any, op: str = "CREATE", old: Any = None) -> Any:
    req: dict[str, Any] = {"uid": "u-1", "operation": op, "object": pod}
    if old is not None:
        req["oldObject"] = old
    r = _post(client, "/mutate", {"apiVersion": "admission.k8s.io/v1", "request": req})
    assert r.status_code == 200, r.text
    return r.json()["response"]


def test_webhook_denies_an_update_that_changes_the_slice(
    servers: dict[str, httpx.Client],
) -> None:
    hook = servers["webhook"]
    before = pod_object("p", [(30, 4)])
    same = _review(hook, pod_object("p", [(30, 4)]), "UPDATE", before)
    assert same["allowed"] is True and "patch" not in same
    grown = _review(hook, pod_object("p", [(60, 4)]), "UPDATE", before)
    assert grown["allowed"] is False and "cannot change" in grown["status"]["message"]
    broken = _review(hook, pod_object("p", [(150, 4)]), "UPDATE", before)
    assert broken["allowed"] is False and "qgpu-core" in broken["status"]["message"]


def test_webhook_keeps_another_scheduler_and_routes_the_default_one(
    servers: dict[str, httpx.Client],
) -> None:
    hook = servers["webhook"]
    other = _review(hook, pod_object("p", [(30, 4)], scheduler_name="volcano"))
    assert other["allowed"] is False and "patch" not in other
    assert "spec.schedulerName" in other["status"]["message"]
    assert "volcano" in other["status"]["message"]
    defaulted = _review(hook, pod_object("p", [(30, 4)], scheduler_name="default-scheduler"))
    assert defaulted["allowed"] is True
    assert json.loads(base64.b64decode(defaulted["patch"])) == [
        {"op": "add", "path": "/spec/schedulerName", "value": "qgpu-scheduler"}
    ]


def test_webhook_denies_a_malformed_pod_naming_the_field(
    servers: dict[str, httpx.Client],
) -> None:
    out = _review(servers["webhook"], {"spec": {"containers": "x"}})
    assert out["allowed"] is False and "containers" in out["status"]["message"]
    huge = pod_object("p", [(30, 4)])
    huge["spec"]["containers"][0]["resources"]["limits"][NAMES.core] = "1" + "0" * 4000
    out = _review(servers["webhook"], huge)
    assert out["allowed"] is False and len(out["status"]["message"]) < 600
