"""`k8s_bridge.assignment_mac`: what the MAC binds, key rotation, and bad key files."""

from __future__ import annotations

from pathlib import Path

import pytest

from k8s_bridge.assignment_mac import MIN_KEY_BYTES, AssignmentKeys
from qgpu.errors import RuleViolation
from tests.k8s.helpers import one_error_line, run_qgpu

OLD = b"o" * MIN_KEY_BYTES
NEW = b"n" * MIN_KEY_BYTES
TEXT = '{"node":"n0","containers":{},"bound_at":1.5,"lock_epoch":7}'


def test_the_mac_binds_pod_node_and_text() -> None:
    keys = AssignmentKeys(NEW)
    mac = keys.sign("uid-a", "n0", TEXT)
    assert keys.check("uid-a", "n0", TEXT, mac) is None
    for uid, node, text in [
        ("uid-b", "n0", TEXT),  # another pod
        ("uid-a", "n1", TEXT),  # another node
        ("uid-a", "n0", TEXT.replace('"lock_epoch":7', '"lock_epoch":8')),  # another bind
        ("uid-an", "0", TEXT),  # fields cannot slide into each other
    ]:
        assert "does not match" in (keys.check(uid, node, text, mac) or ""), (uid, node)
    assert "does not match" in (keys.check("uid-a", "n0", TEXT, mac[:-1] + "0") or "x")
    assert keys.check("uid-a", "n0", TEXT, None) == "its assignment MAC annotation is missing"
    assert "not a v1 MAC" in (keys.check("uid-a", "n0", TEXT, "v2." + mac[3:]) or "")
    # another key (another cluster, a guess) does not verify
    assert AssignmentKeys(OLD).check("uid-a", "n0", TEXT, mac) is not None


def test_rotation_verifies_with_the_previous_key_and_signs_with_the_current() -> None:
    before = AssignmentKeys(OLD).sign("u", "n0", TEXT)
    rotating = AssignmentKeys(NEW, previous=OLD)
    assert rotating.check("u", "n0", TEXT, before) is None
    assert rotating.sign("u", "n0", TEXT) == AssignmentKeys(NEW).sign("u", "n0", TEXT)
    assert AssignmentKeys(NEW).check("u", "n0", TEXT, before) is not None  # rotation done


def test_key_files_give_one_clear_error(tmp_path: Path) -> None:
    good = tmp_path / "key"
    good.write_bytes(NEW + b"\n")  # a trailing newline (kubectl, editors) is not key material
    prev = tmp_path / "previous"
    keys = AssignmentKeys.from_files(good, prev)  # no previous file: no rotation
    assert keys == AssignmentKeys(NEW)
    prev.write_bytes(OLD)
    assert AssignmentKeys.from_files(good, prev).previous == OLD
    empty = tmp_path / "empty"
    empty.write_bytes(b" \n")
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    cases = [
        (tmp_path / "missing", "--assignment-key-file", "cannot be read: No such file"),
        (empty, "--assignment-key-file", "is empty"),
        (
            short,
            "--assignment-key-file",
            f"holds 3 bytes: an assignment key needs at least {MIN_KEY_BYTES}",
        ),
    ]
    for path, field, rule in cases:
        with pytest.raises(RuleViolation) as info:
            AssignmentKeys.from_files(path)
        assert (
            info.value.field == field and str(path) in str(info.value) and rule in str(info.value)
        )
    with pytest.raises(RuleViolation, match="--assignment-previous-key-file"):
        AssignmentKeys.from_files(good, short)


@pytest.mark.parametrize(
    ("command", "content", "says"),
    [
        (["extender"], b"\n", "--assignment-key-file {path}: is empty"),
        (["device-plugin", "--node-name=n0"], None, "--assignment-key-file {path}: cannot be read"),
    ],
)
def test_commands_refuse_a_bad_key_file_in_one_line(
    tmp_path: Path, command: list[str], content: bytes | None, says: str
) -> None:
    path = tmp_path / "key"
    if content is not None:
        path.write_bytes(content)
    proc = run_qgpu(*command, f"--assignment-key-file={path}", "--apiserver=http://127.0.0.1:9")
    assert one_error_line(proc).startswith(f"error: {says.format(path=path)}"), proc.stderr
