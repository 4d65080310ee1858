"""What NVML's video-engine calls tell a tenant, read with NVIDIA's own client (nvidia-ml-py's
pynvml): on every GPU of the node, the encoder and frame-buffer capture sessions (the pid
of each) and their statistics. Reports ``enc_pid <pid>`` / ``fbc_pid <pid>`` per session,
``enc_count<i>``, ``enc_fps<i>``, ``fbc_count<i>``, ``fbc_fps<i>`` per GPU i, and
``err_<what><i>`` for a call NVML refused (its NVML_ERROR code)."""

from __future__ import annotations

import pynvml as nv
from hostile_cb import say


def main() -> None:
    nv.nvmlInit()
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        for what, call in (
            ("enc", nv.nvmlDeviceGetEncoderSessions),
            ("fbc", nv.nvmlDeviceGetFBCSessions),
        ):
            try:
                for s in call(h):
                    say(f"{what}_pid", s.pid)
            except nv.NVMLError as e:
                say(f"err_{what}{i}", e.value)
        try:
            count, fps, _latency = nv.nvmlDeviceGetEncoderStats(h)
            say(f"enc_count{i}", count)
            say(f"enc_fps{i}", fps)
        except nv.NVMLError as e:
            say(f"err_encstats{i}", e.value)
        try:
            stats = nv.nvmlDeviceGetFBCStats(h)
            say(f"fbc_count{i}", stats.sessionsCount)
            say(f"fbc_fps{i}", stats.averageFPS)
        except nv.NVMLError as e:
            say(f"err_fbcstats{i}", e.value)
    say("ready", 0)


if __name__ == "__main__":
    main()
