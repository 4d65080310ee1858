"""Errors of the core: every rejection names the field, the value and the rule.

`RuleViolation` is the one exception type the core raises for bad input. Adapters turn it
into their own transport's error (HTTP 4xx JSON, gRPC status, CLI exit code 2) through
`RuleViolation.as_dict()` / `str()`, so the wording stays the same everywhere.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


def safe_text(text: str, limit: int = 200) -> str:
    """`text` truncated to `limit` characters (saying how long it was), lone surrogates
    escaped: what an error message may echo of a value, however hostile."""
    cut = text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
    try:
        cut.encode("utf-8")
    except UnicodeEncodeError:
        cut = cut.encode("utf-8", "backslashreplace").decode("utf-8")
    return cut


class QgpuError(Exception):
    """Base class of qgpu's own errors."""


ECHO_LIMIT = 120  # characters of an offending value repeated in a message


def echo(value: Any, limit: int = ECHO_LIMIT) -> str:
    """``repr(value)``, cut to `limit` characters: a message repeats what it was sent, never
    megabytes of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class RuleViolation(QgpuError, ValueError):
    """A value broke one of the slice model's rules.

    Attributes:
        field: the user-facing field name (``qgpu-core``, ``qgpu-memory``, ``isolation``...),
            or the command-line flag it came from (``--memory``).
        value: the offending value as the user gave it; None when it is missing.
        rule: a sentence stating the rule that was broken.
    """

    def __init__(self, field: str, value: Any, rule: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        # a missing value reads "qgpu-memory: is required ...", never "qgpu-memory=None: ..."
        super().__init__(f"{field}: {rule}" if value is None else f"{field}={echo(value)}: {rule}")

    def renamed(self, field: str) -> RuleViolation:
        """The same violation under the name the user typed (a flag such as ``--memory``)."""
        return RuleViolation(field, self.value, self.rule)

    def as_dict(self) -> dict[str, Any]:
        value = self.value
        if not isinstance(value, str | int | float | bool | type(None)) or (
            len(echo(value)) > ECHO_LIMIT
        ):
            value = echo(value)
        return {"field": self.field, "value": value, "rule": self.rule}


class NoFit(QgpuError):
    """A valid request that no GPU can take right now; `reasons` says why per candidate."""

    def __init__(self, message: str, reasons: dict[str, int] | None = None) -> None:
        self.reasons = dict(reasons or {})
        super().__init__(message)


def violations_from_pydantic(exc: ValidationError) -> list[RuleViolation]:
    """Turn a pydantic ValidationError into RuleViolations that name field, value and rule.

    Our own validators raise `RuleViolation` (kept as is); pydantic's built-in checks
    (wrong type, missing field, extra field) are rephrased with the field's dotted path.
    """
    out: list[RuleViolation] = []
    for err in exc.errors(include_url=False):
        ctx = err.get("ctx") or {}
        inner = ctx.get("error")
        if isinstance(inner, RuleViolation):
            out.append(inner)
            continue
        loc = ".".join(str(p) for p in err.get("loc", ())) or "request"
        value = err.get("input")
        kind = err.get("type", "")
        if kind == "missing":
            out.append(RuleViolation(loc, None, "this field is required"))
        elif kind == "extra_forbidden":
            out.append(RuleViolation(loc, value, "unknown field"))
        else:
            msg = str(err.get("msg", "invalid value"))
            msg = msg.removeprefix("Value error, ")
            out.append(RuleViolation(loc, value, msg))
    return out


def first_violation(exc: ValidationError) -> RuleViolation:
    """The first RuleViolation of a pydantic ValidationError (for one-line messages)."""
    found = violations_from_pydantic(exc)
    return found[0] if found else RuleViolation("request", None, str(exc))
