"""Fetch the Alibaba GPU-sharing traces that `bench/trace_replay.py` replays, and check them.

The files ship in `bench/traces/` (see its README for their source, attribution and terms);
this script downloads any that are missing from their public source, pinned to one commit
of alibaba/clusterdata, and checks every file against `bench/traces/SHA256SUMS`. A file
whose checksum differs is an error (exit 1), never used silently.

Usage: ``python bench/fetch_traces.py [--check] [--dest DIR] [--base-url URL]``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

TRACES = Path(__file__).resolve().parent / "traces"
SUMS = TRACES / "SHA256SUMS"
BASE_URL = (
    "https://raw.githubusercontent.com/alibaba/clusterdata/"
    "50a91c7c74abe3b658188dc78ac1dd302970d40c/cluster-trace-gpu-v2023/csv"
)


def expected_sums(path: Path = SUMS) -> dict[str, str]:
    """File name -> SHA-256, from a ``sha256sum`` listing."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            out[name.strip().lstrip("*")] = digest
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(name: str, dest: Path, base_url: str, digest: str) -> None:
    """Download one file next to `dest`, check it, then move it into place."""
    with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=f".{name}.", delete=False) as tmp:
        part = Path(tmp.name)
    try:
        with urllib.request.urlopen(f"{base_url}/{name}", timeout=60) as reply:
            part.write_bytes(reply.read())
        got = sha256(part)
        if got != digest:
            raise SystemExit(f"fetch_traces: {name}: checksum {got} is not the expected {digest}")
        part.replace(dest)
    finally:
        part.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only check the files, fetch nothing")
    p.add_argument("--dest", default=str(TRACES), help="where the files are (default: %(default)s)")
    p.add_argument(
        "--base-url", default=BASE_URL, help="where to download from (default: %(default)s)"
    )
    args = p.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    bad = 0
    for name, digest in expected_sums().items():
        path = dest / name
        if not path.exists():
            if args.check:
                print(f"{name}: missing", file=sys.stderr)
                bad += 1
                continue
            print(f"{name}: downloading from {args.base_url}", flush=True)
            fetch(name, path, args.base_url, digest)
        got = sha256(path)
        if got != digest:
            print(f"{name}: checksum {got} is not the expected {digest}", file=sys.stderr)
            bad += 1
        else:
            print(f"{name}: ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
