"""The hold-out variants of the Alibaba trace family (bench/trace_variants.py): each variant
is what its name says, made from the shipped files, the same rows every time, and readable
by the replay; a bad name is refused with the rule."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


tv = _load("trace_variants")
tr = _load("trace_replay")


def _kinds(rows):
    return {k: sum(tv._kind(r) == k for r in rows) for k in ("cpu", "share", "whole")}


def test_variants_are_what_their_names_say(tmp_path):
    default = tv.read(tv.TRACES / tv.POD_FILES[0])
    kinds = _kinds(default)
    gpu_pods = kinds["share"] + kinds["whole"]
    for percent in (20, 100):
        rows = tv.pods_variant(f"share{percent}", tv.TRACES)
        assert len(rows) == len(default)
        got = _kinds(rows)
        assert got["cpu"] == kinds["cpu"]
        assert got["share"] == round(gpu_pods * percent / 100)
    shifted = tv.pods_variant("shift3", tv.TRACES)
    for old, new in zip(default, shifted, strict=True):
        if tv._kind(old) == "share":
            assert int(new["gpu_milli"]) == min(950, int(old["gpu_milli"]) + 30)
        else:
            assert (new["num_gpu"], new["gpu_milli"]) == (old["num_gpu"], old["gpu_milli"])
    multi = tv.pods_variant("multi50", tv.TRACES)
    assert sum(int(r["num_gpu"]) > 1 for r in multi) > sum(int(r["num_gpu"]) > 1 for r in default)
    assert {tv._kind(r) for r in multi} == {"cpu", "share", "whole"}
    assert tv.pods_variant("boot1", tv.TRACES) == tv.pods_variant("boot1", tv.TRACES)
    assert tv.pods_variant("boot1", tv.TRACES) != tv.pods_variant("boot2", tv.TRACES)
    nodes = tv.nodes_variant("no-G2", tv.TRACES)
    assert nodes and all(r["model"] != "G2" for r in nodes)
    # the command line writes files the replay reads
    assert tv.main(["--out", str(tmp_path), "share60", "half"]) == 0
    pods = tr.load_pods(tmp_path / "openb_pod_list_share60.csv")
    half = tr.load_nodes(tmp_path / "openb_node_list_half.csv")
    assert (
        len(pods) == len(default) and len(half) == (len(tv.read(tv.TRACES / tv.NODE_FILE)) + 1) // 2
    )


@pytest.mark.parametrize(
    ("name", "rule"),
    [("share101", "0..100"), ("no-H100", "no node has model"), ("bogus", "not shareP")],
)
def test_a_bad_variant_name_is_refused_with_the_rule(tmp_path, name, rule):
    with pytest.raises(SystemExit, match=rule):
        tv.main(["--out", str(tmp_path), name])
