"""The bridge apps' 4xx bodies outside their verbs: a wrong path or method names the field.

FastAPI answers an unknown path or a method a route does not take with
``{"detail": "Not Found"}``; the extender and the webhook answer every 4xx with the field,
the value and the rule instead (the extender also with kube-scheduler's ``Error``), as
their verbs do. `ViolationBody` is that body's documented shape (OpenAPI), `ERRORS` the
responses every route may give, and `name_http_errors` installs the handler.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from qgpu.errors import RuleViolation


class ViolationBody(BaseModel):
    """A 4xx answer: the field, the value and the rule it broke."""

    field: str
    value: Any = None
    rule: str


class ExtenderViolationBody(ViolationBody):
    """The extender's 4xx answer: kube-scheduler's ``Error`` plus field, value and rule."""

    error: str = Field(alias="Error")


def errors(model: type[ViolationBody]) -> dict[int | str, dict[str, Any]]:
    """The 404 and 405 any path or method may get, documented with `model`."""
    return {
        404: {"model": model, "description": "no such endpoint"},
        405: {"model": model, "description": "the endpoint does not take this method"},
    }


def violation_for(request: Request, exc: HTTPException) -> RuleViolation:
    if exc.status_code == 404:
        return RuleViolation("path", request.url.path, "no such endpoint")
    if exc.status_code == 405:
        rule = f"method {request.method} is not allowed on {request.url.path}"
        return RuleViolation("method", request.method, rule)
    return RuleViolation("request", None, str(exc.detail))


def name_http_errors(app: FastAPI, error_key: str | None = None) -> None:
    """Answer FastAPI's own HTTP errors (404, 405, ...) with field, value and rule; with
    `error_key`, the one-line message is also under that key (the extender's ``Error``)."""

    async def handler(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        v = violation_for(request, exc)
        body = v.as_dict()
        if error_key:
            body = {error_key: str(v), **body}
        return Response(
            json.dumps(body).encode(),
            status_code=exc.status_code,
            media_type="application/json",
            headers=exc.headers,
        )

    app.add_exception_handler(HTTPException, handler)
