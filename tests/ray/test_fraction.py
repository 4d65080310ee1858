"""What ``num_gpus=f`` means on a qgpu node (`qgpu_ray.fraction`): no cluster needed."""

from __future__ import annotations

import pytest

from qgpu.errors import RuleViolation
from qgpu_ray.fraction import FractionRule, fraction_slice, whole_gpus


@pytest.mark.parametrize(
    ("amount", "card", "core", "booked", "memory"),
    [
        (0.25, 40, 25, 25.0, 10),  # round(f x 100) %, floor(f x GiB)
        (0.3, 80, 30, 30.0, 24),
        (1 / 3, 80, 33, 33.3333, 26),  # booked = what Ray booked, not the rounded cap
        (0.999, 80, 99, 99.9, 79),  # never a whole card: a 99 % share with a memory cap
        (0.025, 40, 2, 2.5, 1),
    ],
)
def test_proportional_rule(amount, card, core, booked, memory):
    s = fraction_slice(amount, card)
    assert (s.core, s.booked_core, s.memory_gib) == (core, booked, memory)


def test_a_node_rule_of_fixed_gib_and_percent_per_tenth():
    rule = FractionRule.parse(core="5", memory="2Gi")
    s = fraction_slice(0.5, 80, rule)
    assert (s.core, s.booked_core, s.memory_gib) == (25, 25.0, 10)
    assert FractionRule.from_text(rule.to_text()) == rule
    assert FractionRule.from_text(None) == FractionRule()


def test_too_small_a_fraction_names_the_smallest_allowed():
    with pytest.raises(RuleViolation) as err:
        fraction_slice(0.02, 40)
    assert err.value.field == "num_gpus"
    assert "0 GiB" in str(err.value) and "1/40 = 0.025" in str(err.value)
    with pytest.raises(RuleViolation, match="compute share"):
        fraction_slice(0.004, 1000)


@pytest.mark.parametrize(
    ("core", "memory", "field"),
    [
        ("lots", None, "fraction-core"),
        (None, "-1", "fraction-memory"),
        ("11", None, "fraction-core"),
        (None, "0", "fraction-memory"),
    ],
)
def test_bad_node_rules_name_the_field(core, memory, field):
    with pytest.raises(RuleViolation) as err:
        FractionRule.parse(core=core, memory=memory)
    assert err.value.field == field and err.value.value in (core, memory)
    assert "\n" not in str(err.value)


def test_a_rule_whose_whole_gpu_exceeds_the_smallest_card_is_refused():
    rule = FractionRule.parse(memory="8")
    rule.check_cards([80, 80])
    with pytest.raises(RuleViolation, match="smallest card \\(40 GiB\\)"):
        rule.check_cards([80, 40])


def test_whole_gpus():
    assert whole_gpus(0.5) is None
    assert whole_gpus(2) == 2
    with pytest.raises(RuleViolation, match="whole number"):
        whole_gpus(1.5)
