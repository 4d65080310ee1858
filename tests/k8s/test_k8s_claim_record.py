"""`k8s_bridge.deviceplugin.claim_record` and how claims merge with the pod's annotation."""

from __future__ import annotations

import stat
from pathlib import Path

from k8s_bridge.deviceplugin.claim_record import ClaimRecord
from k8s_bridge.deviceplugin.claims import merge_claims
from k8s_bridge.protocol import Allocated

IDS = ["G_c0", "G_c1"]


def test_the_record_survives_a_restart_is_private_and_forgets_gone_pods(tmp_path: Path) -> None:
    path = tmp_path / "k8s" / "claims.json"
    rec = ClaimRecord(path)
    a = Allocated().with_claim("c0", "core", IDS)
    rec.put("uid-a", a)
    rec.put("uid-b", Allocated().with_claim("c0", "memory", ["G_m0"]))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = ClaimRecord(path)  # the plugin restarted
    assert again.get("uid-a") == a
    again.keep_only(["uid-a", "uid-c"])
    assert set(ClaimRecord(path).snapshot()) == {"uid-a"}


def test_an_unreadable_record_starts_empty(tmp_path: Path, caplog) -> None:
    path = tmp_path / "claims.json"
    path.write_text("{not json")
    assert ClaimRecord(path).snapshot() == {}
    assert "ignoring the claim record" in caplog.text
    path.write_text('{"uid-a": {"containers": {"c0": ["gpu"]}}, "uid-b": {}}')
    assert set(ClaimRecord(path).snapshot()) == {"uid-b"}


def test_the_record_wins_and_the_annotation_only_adds() -> None:
    record = Allocated().with_claim("c0", "core", IDS)
    # the owner removed its claim annotation: the record still says claimed
    assert merge_claims(Allocated(), record) == record
    # the owner rewrote the IDs: the recorded ones stay
    forged = Allocated().with_claim("c0", "core", ["G_c7", "G_c8"])
    assert merge_claims(forged, record).claimed_ids("c0", "core") == IDS
    # a claim only the annotation has (the plugin died before recording it) is kept
    more = forged.with_claim("c0", "memory", ["G_m1"])
    merged = merge_claims(more, record)
    assert merged.claimed("c0") == {"core", "memory"}
    assert merged.claimed_ids("c0", "memory") == ["G_m1"]
    assert merge_claims(more, None) == more
