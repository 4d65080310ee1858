"""The agent's error answers: every rejection as an `ErrorBody` (field, value, rule), with
every echoed value made safe to send back.

An echoed value is truncated (strings to 200 characters, at most 16 items per list or
mapping, 4 levels deep) and made valid Unicode (a lone surrogate is written as its
``\\udXXX`` escape), so that no input, however hostile, can make the error answer itself
fail or grow with the request.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from enforcement.agent.models import ErrorBody, Violation
from qgpu.errors import RuleViolation, safe_text

MAX_ECHO_CHARS = 200
MAX_ECHO_ITEMS = 16
MAX_ECHO_DEPTH = 4


def echo(value: Any, depth: int = 0) -> Any:
    """A JSON-safe, bounded copy of a value to put in an error answer."""
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**63 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, bytes):
        return safe_text(value[: MAX_ECHO_CHARS * 4].decode("utf-8", "replace"))
    if depth >= MAX_ECHO_DEPTH:
        return "..."
    if isinstance(value, list | tuple):
        out = [echo(v, depth + 1) for v in value[:MAX_ECHO_ITEMS]]
        if len(value) > MAX_ECHO_ITEMS:
            out.append(f"... ({len(value)} items)")
        return out
    if isinstance(value, dict):
        items = list(value.items())
        body = {safe_text(str(k), 64): echo(v, depth + 1) for k, v in items[:MAX_ECHO_ITEMS]}
        if len(items) > MAX_ECHO_ITEMS:
            body["..."] = f"{len(items)} entries"
        return body
    return safe_text(repr(value))


def error_response(
    status: int,
    kind: str,
    violations: list[RuleViolation],
    reasons: dict[str, int] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    items = [
        Violation(field=safe_text(v.field, 128), value=echo(v.value), rule=safe_text(v.rule, 1000))
        for v in violations[:MAX_ECHO_ITEMS]
    ]
    first = items[0]
    body = ErrorBody(
        error=kind,  # type: ignore[arg-type]
        field=first.field,
        value=first.value,
        rule=first.rule,
        violations=items,
        reasons=reasons or {},
    )
    return JSONResponse(status_code=status, content=body.model_dump(mode="json"), headers=headers)


def violations_from_request_errors(errors: list[dict[str, Any]]) -> list[RuleViolation]:
    """FastAPI's request validation errors as field/value/rule (body prefix dropped)."""
    out: list[RuleViolation] = []
    for err in errors:
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, RuleViolation):
            out.append(inner)
            continue
        loc = [str(p) for p in err.get("loc", ())]
        if loc and loc[0] in ("body", "path", "query", "header"):
            loc = loc[1:] or loc
        field = ".".join(loc) or "request"
        kind = err.get("type", "")
        value = err.get("input")
        if kind == "missing":
            out.append(RuleViolation(field, None, "this field is required"))
        elif kind == "extra_forbidden":
            out.append(RuleViolation(field, value, "unknown field"))
        elif kind == "json_invalid":
            out.append(RuleViolation("body", None, "must be valid JSON"))
        else:
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            out.append(RuleViolation(field, value, msg))
    return out or [RuleViolation("request", None, "invalid request")]


__all__ = ["echo", "error_response", "safe_text", "violations_from_request_errors"]
