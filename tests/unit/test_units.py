"""Unit tests for qgpu.units: every accepted spelling and every rejection."""

from __future__ import annotations

import pytest

from qgpu.errors import RuleViolation
from qgpu.units import parse_core, parse_memory_gib


@pytest.mark.parametrize(
    ("value", "gib"),
    [
        (8, 8),
        ("8", 8),
        ("8Gi", 8),
        ("8192Mi", 8),
        ("8G", 8),
        ("8GiB", 8),
        ("1Ti", 1024),
        (8.0, 8),
        (" 16 Gi ", 16),
    ],
)
def test_memory_spellings(value, gib):
    assert parse_memory_gib(value) == gib


@pytest.mark.parametrize(
    "value", [0, -1, "abc", "0Gi", "8.5", "1000Mi", "8Qi", None, True, [], 7.5]
)
def test_memory_rejections_name_field_value_and_rule(value):
    with pytest.raises(RuleViolation) as info:
        parse_memory_gib(value)
    err = info.value
    assert err.field == "qgpu-memory"
    assert err.value == value
    assert "whole number of GiB" in err.rule
    # a missing value reads "qgpu-memory: ...", never "qgpu-memory=None: ..."
    head = "qgpu-memory: " if value is None else f"qgpu-memory={value!r}: "
    assert str(err).startswith(head)


@pytest.mark.parametrize(("value", "core"), [(30, 30), ("30", 30), ("30%", 30), (200.0, 200)])
def test_core_spellings(value, core):
    assert parse_core(value) == core


@pytest.mark.parametrize("value", ["thirty", 30.5, None, False, "3 0"])
def test_core_syntax_rejections(value):
    with pytest.raises(RuleViolation) as info:
        parse_core(value)
    assert info.value.field == "qgpu-core"


@pytest.mark.parametrize(
    ("raw", "field", "rule"),
    [
        ({"core": "1" + "0" * 4000}, "qgpu-core", "out of range"),  # past int() digit limit too
        ({"core": "1" + "0" * 5000}, "qgpu-core", "out of range"),
        ({"core": 10**30}, "qgpu-core", "at most 102400"),
        ({"core": 30, "memory_gib": 2**31}, "qgpu-memory", "at most 65536 GiB"),
        ({"core": 30, "memory": "9" * 300}, "qgpu-memory", "at most 65536 GiB"),
    ],
)
def test_huge_amounts_break_a_rule_and_are_echoed_short(raw, field, rule):
    from qgpu.errors import ECHO_LIMIT
    from qgpu.model import SliceRequest

    with pytest.raises(RuleViolation) as info:
        SliceRequest.parse(raw)
    assert info.value.field == field and rule in info.value.rule
    assert len(str(info.value)) < ECHO_LIMIT + len(field) + len(info.value.rule) + 40
    assert len(str(info.value.as_dict()["value"])) < ECHO_LIMIT + 40
