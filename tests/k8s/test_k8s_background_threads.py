"""The extender's background threads (binds, watches, lock releaser) run as batch work, so
they never preempt the event loop answering kube-scheduler; the event loop's thread does not.
(SCHED_BATCH is Linux's, as is everything the bridge runs on.)"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from k8s_bridge.extender import background
from k8s_bridge.extender.app import Verbs
from k8s_bridge.extender.background import as_background_thread
from k8s_bridge.extender.service import Extender, ExtenderConfig
from k8s_bridge.kube import Kube
from tests.fakes.apiserver import FakeApiserver
from tests.k8s.helpers import NAMES, publish_node, wait_until


def _in_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_only_the_calling_thread_becomes_batch_work() -> None:
    before = os.sched_getscheduler(0)
    assert _in_thread(lambda: (as_background_thread(), os.sched_getscheduler(0))) == (
        True,
        os.SCHED_BATCH,
    )
    assert os.sched_getscheduler(0) == before  # this thread is untouched


def test_the_bind_threads_are_batch_work() -> None:
    verbs = Verbs(extender=None, bind_threads=2)  # type: ignore[arg-type]
    try:
        assert verbs.binders.submit(os.sched_getscheduler, 0).result() == os.SCHED_BATCH
    finally:
        verbs.binders.shutdown()


def test_a_refused_or_missing_policy_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise PermissionError("not allowed here")

    monkeypatch.setattr(background.os, "sched_setscheduler", refuse, raising=False)
    assert _in_thread(as_background_thread) is False
    monkeypatch.delattr(background.os, "sched_setscheduler", raising=False)
    assert _in_thread(as_background_thread) is False


def test_the_watch_threads_are_batch_work(apiserver: FakeApiserver) -> None:
    publish_node(apiserver, "n0", [])
    ext = Extender(Kube(apiserver.client(), NAMES), ExtenderConfig(watch=True))
    ext.start()
    try:
        watches = [t for t in ext._threads if t.name.startswith("qgpu-watch-")]
        assert len(watches) == 2
        wait_until(
            lambda: all(os.sched_getscheduler(t.native_id) == os.SCHED_BATCH for t in watches),
            5,
            "the watch threads to become batch work",
        )
    finally:
        ext.stop()
