"""frag's request-mix prior (`qgpu.mix_prior`) and its keep-empty rule (`qgpu.frag`)."""

from __future__ import annotations

import json
import os
import random

import pytest

from qgpu.cli import main as cli_main
from qgpu.errors import RuleViolation
from qgpu.frag import KEEP_EMPTY_EVIDENCE, FragPolicy
from qgpu.mix_prior import (
    DEFAULT_PRIOR,
    PRIOR_ENV,
    configured_prior,
    load_prior,
    parse_prior,
    pool_prior,
    prior_setting,
    use_prior,
)
from qgpu.model import GpuDevice, GpuHealth, NodeInventory, SliceRequest
from qgpu.placement import ClusterState, Engine

WHOLE = SliceRequest(core=100)


def node(name: str, gpus: int, gib: int = 80) -> NodeInventory:
    return NodeInventory(
        name=name,
        gpus=[
            GpuDevice(uuid=f"{name}-g{i}", index=i, model="M", memory_mib=gib * 1024)
            for i in range(gpus)
        ],
    )


def test_settings_mean_what_the_docs_say(tmp_path, monkeypatch):
    monkeypatch.delenv(PRIOR_ENV, raising=False)
    assert configured_prior() == DEFAULT_PRIOR
    assert prior_setting("default") == DEFAULT_PRIOR
    assert prior_setting("none") is None and prior_setting("pool") == "pool"
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        "strength: 10\nshapes:\n- {core: 50, memory: 8Gi, weight: 3}\n- {core: 100, weight: 2}\n"
    )
    prior = prior_setting(str(mix))
    assert prior is not None and prior != "pool"
    assert [(s.core, s.memory, n) for s, n in prior.counts()] == [(50, 8, 6), (100, None, 4)]
    monkeypatch.setenv(PRIOR_ENV, str(mix))
    assert configured_prior() == prior
    assert FragPolicy().prior == prior and FragPolicy(measure="fgd").prior is None


def test_the_pool_prior_adds_a_whole_node_of_every_size():
    shapes = pool_prior([node("a", 4), node("b", 2), node("c", 1), node("d", 4)]).shapes
    assert [s.core for s in shapes] == [100, 200, 400]


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"shapes": [{"core": 250}]}, "mix prior.shapes[0].qgpu-core"),
        ({"shapes": [{"core": 150, "memory": 1}]}, "mix prior.shapes[0].qgpu-memory"),
        ({"shapes": [{"core": 50}, {"core": 50, "weight": 0}]}, "mix prior.shapes[1].weight"),
        ({"shapes": []}, "mix prior.shapes"),
        ({"strength": -1, "shapes": [{"core": 50}]}, "mix prior.strength"),
        ({"shapes": [{"core": 50, "colour": 1}]}, "mix prior.shapes[0].colour"),
        ("fifty", "mix prior"),
    ],
)
def test_a_broken_prior_names_the_field(value, field):
    with pytest.raises(RuleViolation) as caught:
        parse_prior(value)
    assert caught.value.field == field


def test_a_bad_flag_is_refused_before_it_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv(PRIOR_ENV, "none")
    with pytest.raises(RuleViolation) as caught:
        use_prior(str(tmp_path / "missing.yaml"))
    assert caught.value.field == "--mix-prior"
    assert os.environ[PRIOR_ENV] == "none"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"core": 50, "weight": -2}]))
    with pytest.raises(RuleViolation) as caught:
        load_prior(bad)
    assert caught.value.field == f"{bad}.shapes[0].weight"


def test_the_readme_example_places_every_request_with_the_default(monkeypatch, capsys):
    monkeypatch.setenv(PRIOR_ENV, "default")  # restored afterwards (the flag sets it)
    args = ["plan", "--nodes", "examples/nodes.yaml", "--requests", "examples/requests.yaml"]
    assert cli_main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["unplaced"] == [] and len(result["placed"]) == 9
    # the flag reaches the same policy: with the pool's whole nodes as the prior, the
    # first shares go to the small node and the whole-card request finds no empty GPU
    assert cli_main([*args, "--json", "--mix-prior", "pool"]) == 0
    assert [u["name"] for u in json.loads(capsys.readouterr().out)["unplaced"]] == ["whole-card"]


def test_the_prior_counts_as_arrivals_before_the_first_decision_and_fades():
    policy = FragPolicy(prior=DEFAULT_PRIOR)
    engine = Engine(ClusterState([node("n", 2)]), policy)
    engine.place("a", SliceRequest(core=30, memory_gib=1))
    # 4 whole-GPU arrivals from the prior, beside the one real share
    assert policy.mix() == {(100, 1, 0, 0): 4 / 5, (30, 1, 0, 0): 1 / 5}
    for _ in range(35):
        engine.observe(SliceRequest(core=30, memory_gib=1))
    assert policy.mix()[(100, 1, 0, 0)] == 4 / 40
    # a shape counts as the request it stands for: 150 is 75% on each of 2 GPUs
    split = FragPolicy(prior=parse_prior([{"core": 150, "memory": 8, "model": "T4|A10"}]))
    Engine(ClusterState([node("n", 2)]), split).decide(WHOLE)
    assert (split._k_core, split._k_mem, split._k_count) == ([75], [4], [2])  # decide: no count
    assert split._k_models[0] == ("T4", "A10")
    # a pool prior knows the node sizes of the cluster it first decides on
    pool = FragPolicy(prior="pool")
    Engine(ClusterState([node("n", 2), node("m", 4)]), pool).decide(WHOLE)
    assert set(pool.mix()) == {(100, 1, 0, 0), (100, 2, 0, 0), (100, 4, 0, 0)}


def test_below_half_full_a_share_never_opens_an_empty_gpu_a_used_one_could_spare():
    # the case the keep-empty rule was made for (found by the binpack property test): a 30%
    # share on g0, a whole GPU on g1, then a 50% share. Learnt from those three, the gap
    # values keep g0's 70% gap for another 50 + ... and open g2; then a 2-GPU request finds
    # one empty GPU. With the rule the 50 goes beside the 30 and the 2-GPU request fits.
    placed = {}
    for keep in (0.0, None):
        engine = Engine(ClusterState([node("n", 4)]), FragPolicy(prior=None, keep_empty=keep))
        engine.place("a", SliceRequest(core=30, memory_gib=2))
        engine.place("b", SliceRequest(core=100))
        placed[keep] = engine.place("c", SliceRequest(core=50, memory_gib=5)).gpu_uuids
        engine.state.check_invariants()
    assert placed == {0.0: ("n-g2",), None: ("n-g0",)}
    with pytest.raises(ValueError, match="keep_empty"):
        FragPolicy(keep_empty=1.5)
    with pytest.raises(ValueError, match="keep_empty_until"):
        FragPolicy(keep_empty_until=-1)


def test_the_keep_empty_rule_lapses_once_enough_requests_were_seen():
    # the same three requests; the rule holds while fewer than `keep_empty_until` requests
    # have been seen (the 50 is the third), then frag's own scores decide (they open g2)
    placed = {}
    for until in (3, 4, 0):
        engine = Engine(
            ClusterState([node("n", 4)]), FragPolicy(prior=None, keep_empty_until=until)
        )
        engine.place("a", SliceRequest(core=30, memory_gib=2))
        engine.place("b", SliceRequest(core=100))
        placed[until] = engine.place("c", SliceRequest(core=50, memory_gib=5)).gpu_uuids
    assert placed == {3: ("n-g2",), 4: ("n-g0",), 0: ("n-g0",)}  # 0: it never lapses
    # by default it lapses when the mix is known to within frag's repricing drift (5%)
    assert FragPolicy().keep_empty_until == KEEP_EMPTY_EVIDENCE == 400
    assert FragPolicy(measure="fgd").keep_empty == 0  # the paper's measure stays as published


def _three_requests(policy: FragPolicy, cluster: list[NodeInventory]) -> tuple[str, ...]:
    """The rule's case: a 30% share, a whole GPU, then a 50% share; where the 50 goes."""
    engine = Engine(ClusterState(cluster), policy)
    engine.place("a", SliceRequest(core=30, memory_gib=2))
    engine.place("b", SliceRequest(core=100))
    placed = engine.place("c", SliceRequest(core=50, memory_gib=5)).gpu_uuids
    engine.state.check_invariants()
    return placed


def test_the_keep_empty_rule_is_not_taken_where_it_cannot_pay_out():
    # n holds the 30 and the whole GPU; m0, m1, ... are empty 4-GPU nodes. With the rule
    # lapsing after 5 requests, 2 more requests can come after the 50 (the third): with
    # 2 spare empty nodes they could break both, so the rule holds (the 50 goes beside the
    # 30); with 3 no request before the lapse can miss a whole empty node, and frag's own
    # scores decide, exactly as without the rule
    def cluster(spare: int, sick: bool = False) -> list[NodeInventory]:
        nodes = [node("n", 4)] + [node(f"m{i}", 4) for i in range(spare)]
        if sick:  # a node with a broken GPU cannot take a 4-GPU request
            gpus = [
                g.model_copy(update={"health": GpuHealth.UNHEALTHY}) if i == 0 else g
                for i, g in enumerate(nodes[1].gpus)
            ]
            nodes[1] = nodes[1].model_copy(update={"gpus": gpus})
        return nodes

    def rule() -> FragPolicy:
        return FragPolicy(prior=None, keep_empty_until=5)

    def no_rule() -> FragPolicy:
        return FragPolicy(prior=None, keep_empty=0)

    assert _three_requests(rule(), cluster(2)) == ("n-g0",)
    assert _three_requests(rule(), cluster(3, sick=True)) == ("n-g0",)
    lifted = _three_requests(rule(), cluster(3))
    assert lifted == _three_requests(no_rule(), cluster(3)) != ("n-g0",)
    # held to half fill (it never lapses): always taken
    assert _three_requests(FragPolicy(prior=None, keep_empty_until=0), cluster(3)) == ("n-g0",)


@pytest.mark.parametrize("seed", range(6))
def test_where_the_rule_is_not_taken_every_request_before_the_lapse_finds_empty_gpus(seed):
    # the guarantee behind lifting the rule: more spare empty nodes than requests still to
    # come before the lapse, so whatever the shares do, every whole-GPU request of up to a
    # node's GPUs fits; and frag then decides exactly as without the rule
    rng = random.Random(seed)
    until = 12
    cluster = [node(f"n{i}", 4) for i in range(until)] + [node("small", 2)]
    engines = [
        Engine(ClusterState(cluster), FragPolicy(prior=None, keep_empty_until=until)),
        Engine(ClusterState(cluster), FragPolicy(prior=None, keep_empty=0)),
    ]
    for i in range(until - 1):
        if rng.random() < 0.6:
            req = SliceRequest(core=rng.choice([10, 25, 30, 47, 50, 65, 81]), memory_gib=2)
        else:
            req = SliceRequest(core=100 * rng.choice([1, 1, 2, 4]))
        placed = [e.place(f"r{i}", req).gpu_uuids for e in engines]
        assert placed[0] == placed[1]
    for e in engines:
        e.state.check_invariants()


def test_the_agent_and_the_extender_take_the_same_flag(tmp_path, monkeypatch):
    from enforcement.agent.cli import config_from_args
    from qgpu.cli import build_parser

    monkeypatch.setenv(PRIOR_ENV, "default")  # restored afterwards
    parser = build_parser()
    agent = parser.parse_args(
        ["agent", "--sim", "1xT4", "--state-dir", str(tmp_path), "--mix-prior", "pool"]
    )
    config_from_args(agent)
    assert os.environ[PRIOR_ENV] == "pool" and FragPolicy().prior == "pool"
    assert parser.parse_args(["extender", "--mix-prior", "none"]).mix_prior == "none"
    with pytest.raises(RuleViolation, match="--mix-prior"):
        config_from_args(parser.parse_args(["agent", "--mix-prior", "everything"]))


def test_spare_whole_nodes_counts_empty_healthy_nodes_of_the_largest_size():
    sick = node("sick", 4)
    sick = sick.model_copy(
        update={
            "gpus": [
                g.model_copy(update={"health": GpuHealth.UNHEALTHY}) if i == 3 else g
                for i, g in enumerate(sick.gpus)
            ]
        }
    )
    state = ClusterState([node("a", 4), sick, node("b", 4), node("used", 4), node("small", 2)])
    engine = Engine(state, FragPolicy(prior=None))
    assert FragPolicy._spare_whole_nodes(state) == 3  # a, b, used
    assert engine.place("s", SliceRequest(core=10, memory_gib=1)).node in {"a", "b", "used"}
    assert FragPolicy._spare_whole_nodes(state) == 2  # the share broke one of them
    assert FragPolicy._spare_whole_nodes(ClusterState([sick, node("small", 2)])) == 0
