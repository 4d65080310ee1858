"""Schemathesis against the extender's and the webhook's own OpenAPI specs, in process.

Every operation of both apps (the verbs, ``/mutate``, ``/healthz``, ``/metrics``) gets
schema-driven bodies, valid and not: no answer is >= 500, every answer matches the status's
documented schema and content type, and every 4xx body names a field, a value and a rule.
The extender runs over the fake apiserver (two published nodes, no watch).
"""

from __future__ import annotations

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
)

from k8s_bridge.extender.app import create_app as extender_app
from k8s_bridge.extender.service import Extender, ExtenderConfig
from k8s_bridge.kube import Kube
from k8s_bridge.webhook import create_app as webhook_app
from tests.fakes.apiserver import FakeApiserver
from tests.k8s.helpers import NAMES, gpu, publish_node

_SRV = FakeApiserver().start()
for _node in ("n0", "n1"):
    publish_node(_SRV, _node, [gpu(_node, 0), gpu(_node, 1)])
_EXT = Extender(Kube(_SRV.client(), NAMES), ExtenderConfig(watch=False))
_EXT.start()
extender = schemathesis.openapi.from_asgi("/openapi.json", extender_app(_EXT))
webhook = schemathesis.openapi.from_asgi("/openapi.json", webhook_app(NAMES, compat_mode=True))
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
FUZZ = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def teardown_module() -> None:
    _EXT.stop()
    _SRV.stop()


def _check(case) -> None:  # type: ignore[no-untyped-def]
    response = case.call_and_validate(checks=CHECKS)
    if 400 <= response.status_code < 500:
        body = response.json()
        where = (case.method, case.path, response.status_code, body)
        assert "field" in body and body["field"] and body["rule"] and "value" in body, where


@extender.parametrize()
@FUZZ
def test_extender_never_answers_5xx(case) -> None:  # type: ignore[no-untyped-def]
    _check(case)


@webhook.parametrize()
@FUZZ
def test_webhook_never_answers_5xx(case) -> None:  # type: ignore[no-untyped-def]
    _check(case)


def test_unknown_path_and_method_name_the_field() -> None:
    """Outside the spec too: 404 and 405 say which field (path, method) and the rule."""
    with TestClient(extender_app(_EXT)) as ext, TestClient(webhook_app(NAMES)) as hook:
        r = ext.get("/nope/..%2f")
        assert r.status_code == 404 and r.json()["field"] == "path", r.text
        assert r.json()["Error"].startswith("path="), r.text
        r = hook.put("/mutate", json={})
        assert r.status_code == 405 and r.json()["field"] == "method", r.text
        assert r.json()["value"] == "PUT" and r.headers["allow"] == "POST", r.text
