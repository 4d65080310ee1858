"""The Alibaba trace replay (bench/trace_replay.py) on a 50-node slice of the real trace:
every policy keeps the engine's invariants and the replay's counts add up; the mapping of
trace pods to slice requests; the command line writes its table and plot."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "bench" / "traces"  # shipped with the repository (bench/traces/README.md)
NODES_CSV = TRACES / "openb_node_list_gpu_node.csv"
PODS_CSV = TRACES / "openb_pod_list_default.csv"


def _load_replay():
    spec = importlib.util.spec_from_file_location("trace_replay", REPO / "bench/trace_replay.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["trace_replay"] = module
    spec.loader.exec_module(module)
    return module


tr = _load_replay()


@pytest.fixture(scope="module")
def slice_nodes():
    """50 nodes spread over the node list (it is sorted by model), so all models appear."""
    nodes = tr.load_nodes(NODES_CSV)
    step = len(nodes) // 50
    return nodes[::step][:50]


@pytest.fixture(scope="module")
def pods():
    return tr.load_pods(PODS_CSV)


@pytest.mark.parametrize("policy", ["binpack", "spread", "frag", "fgd", "bestfit", "random"])
def test_replay_keeps_invariants_and_counts(slice_nodes, pods, policy):
    r = tr.replay(slice_nodes, pods, policy, seed=42, memory_mode="fraction", keep_state=True)
    state = r.state
    state.check_invariants()  # never over-committed: GPU core, GPU memory, slices, CPU, memory
    assert r.placed + r.failed_gpu + r.failed_cpu_only == r.pods
    gpu_held = [h for h in state.held.values() if len(h.gpus)]
    assert len(gpu_held) == r.gpu_pods - r.failed_gpu
    assert len(state.held) == r.placed
    used = int((state.cap_core - state.free_core).sum())
    assert r.allocated_milli == used * 10 == sum(h.core * len(h.gpus) * 10 for h in gpu_held)
    assert r.capacity_milli == len(state.gpus) * 1000
    assert 0 < r.ratio_at[100] <= r.ratio_at[130] <= 1
    assert len(r.curve) == 130 and all(np.diff(r.curve) >= 0)
    assert r.failed_gpu > 0  # 130% of capacity arrived: some pods cannot fit


def test_frag_beats_binpack_on_the_slice(slice_nodes, pods):
    # deterministic (fixed seeds); the full-trace numbers are in docs/placement.md
    for seed in (42, 43):
        frag = tr.replay(slice_nodes, pods, "frag", seed, "ignore")
        binpack = tr.replay(slice_nodes, pods, "binpack", seed, "ignore")
        assert frag.ratio_at[130] > binpack.ratio_at[130]


def test_workload_inflates_to_130_percent(pods):
    nodes = tr.load_nodes(NODES_CSV)
    capacity = sum(len(n.gpus) for n in nodes) * 1000
    arrivals = tr.workload(pods, capacity, np.random.default_rng(42))
    demand = sum(p.gpu_request_milli for p in arrivals)
    assert capacity * 1.29 < demand <= capacity * 1.3
    assert len(arrivals) > len(pods)  # the whole trace (98%) plus samples with replacement
    assert {p.name for p in pods} <= {p.name for p in arrivals}
    again = tr.workload(pods, capacity, np.random.default_rng(42))
    assert [p.name for p in again] == [p.name for p in arrivals]


def test_pod_to_request_mapping():
    card_gib = {"T4": 14, "G2": 19}
    pod = tr.Pod("p", 6000, 12288, 1, 460, "")
    assert tr.gpu_core(pod) == 46
    assert tr.gpu_core(tr.Pod("p", 0, 0, 1, 455, "")) == 46  # rounded up, never smaller
    assert tr.gpu_core(tr.Pod("p", 0, 0, 1, 1000, "")) == 100
    assert tr.gpu_core(tr.Pod("p", 0, 0, 4, 1000, "")) == 400
    req = tr.to_request(pod, "fraction", card_gib)
    assert (req.core, req.memory_gib, req.cpu_milli, req.host_memory_mib) == (46, 7, 6000, 12288)
    assert tr.to_request(tr.Pod("p", 0, 0, 1, 460, "G2"), "fraction", card_gib).memory_gib == 9
    assert tr.to_request(pod, "ignore", card_gib).memory_gib == 1
    absent = tr.to_request(tr.Pod("p", 0, 0, 1, 460, "A100"), "fraction", card_gib)
    assert (absent.model, absent.memory_gib) == ("A100", 1)  # fits nowhere; no crash
    whole = tr.to_request(tr.Pod("p", 0, 0, 2, 1000, "T4|G2"), "fraction", card_gib)
    assert (whole.core, whole.memory_gib, whole.model) == (200, None, "T4|G2")


@pytest.mark.parametrize("matplotlib", [True, False], ids=["with-plot", "without-matplotlib"])
def test_command_line_writes_table_and_plot(tmp_path, slice_nodes, matplotlib, monkeypatch, capsys):
    if not matplotlib:  # a venv made by `make demo` has no matplotlib
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    nodes_csv = tmp_path / "nodes.csv"
    with open(NODES_CSV, newline="") as src, open(nodes_csv, "w", newline="") as dst:
        rows = list(csv.DictReader(src))
        keep = {n.name for n in slice_nodes}
        writer = csv.DictWriter(dst, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(r for r in rows if r["sn"] in keep)
    out = tmp_path / "out"
    rc = tr.main(
        [
            "--nodes",
            str(nodes_csv),
            "--pods",
            str(PODS_CSV),
            "--policies",
            "binpack,frag",
            "--seeds",
            "42,43",
            "--memory-mode",
            "ignore",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    table = (out / "replay-default-ignore.md").read_text()
    rows = [
        line
        for line in table.splitlines()
        if line.startswith("| binpack") or line.startswith("| frag")
    ]
    assert len(rows) == 2 and all(line.rstrip().endswith("| 2 |") for line in rows)
    png = out / "replay-default-ignore.png"
    if matplotlib:
        assert png.read_bytes().startswith(b"\x89PNG")
    else:
        assert not png.exists()
        assert "no plot: matplotlib is not installed" in capsys.readouterr().err


def _load_fetch():
    spec = importlib.util.spec_from_file_location("fetch_traces", REPO / "bench/fetch_traces.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_traces_match_their_checksums():
    fetch = _load_fetch()
    assert fetch.main(["--check"]) == 0
    assert set(fetch.expected_sums()) == {p.name for p in TRACES.glob("*.csv")}


def test_fetch_downloads_missing_files_and_refuses_a_changed_one(tmp_path):
    fetch = _load_fetch()
    source = tmp_path / "source"
    source.mkdir()
    for name in fetch.expected_sums():
        (source / name).write_bytes((TRACES / name).read_bytes())
    dest = tmp_path / "dest"
    base = source.as_uri()
    assert fetch.main(["--dest", str(dest), "--base-url", base]) == 0
    for name in fetch.expected_sums():
        assert (dest / name).read_bytes() == (TRACES / name).read_bytes()
    changed = dest / "openb_node_list_gpu_node.csv"
    changed.write_text(changed.read_text().replace("P100", "P101", 1))
    assert fetch.main(["--dest", str(dest), "--check"]) == 1
    changed.unlink()
    (source / changed.name).write_text("not the trace\n")
    with pytest.raises(SystemExit, match="checksum"):
        fetch.main(["--dest", str(dest), "--base-url", base])
    assert not changed.exists() and not list(dest.glob(".*"))
