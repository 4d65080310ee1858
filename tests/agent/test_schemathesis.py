"""Schemathesis against the agent's own OpenAPI spec, in process: no 5xx, documented shapes.

Every generated request (valid or not) must get a non-5xx answer whose body matches the
documented schema; every 4xx body must name a field, a value and a rule.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
)

from enforcement.agent.app import create_app
from enforcement.agent.config import AgentConfig
from enforcement.agent.service import Agent
from enforcement.agent.watchdog import Watchdog
from tests.agent.conftest import FakeBackend, h100

_STATE = Path(tempfile.mkdtemp(prefix="qs", dir="/tmp"))
atexit.register(shutil.rmtree, _STATE, True)  # also when the module is collected, not run
_AGENT = Agent(
    AgentConfig(node_name="node-s", state_dir=_STATE, test_mode=True),
    FakeBackend([h100(0), h100(1)]),
)
_AGENT.watchdog = Watchdog(_AGENT)
APP = create_app(_AGENT)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


def teardown_module() -> None:
    _AGENT.close()


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_api_never_answers_5xx(case) -> None:
    response = case.call_and_validate(
        checks=[not_a_server_error, response_schema_conformance, content_type_conformance]
    )
    if 400 <= response.status_code < 500:
        body = response.json()
        assert body["field"] and body["rule"] and "value" in body, body
    assert _AGENT.counters.errors == {}, _AGENT.counters.errors
