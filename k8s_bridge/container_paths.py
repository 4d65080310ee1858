"""Where the device plugin puts a share container's enforcement, inside the container.

One source of truth for the paths the plugin mounts and the environment names it sets
(`k8s_bridge.deviceplugin.allocation` writes them; `k8s_bridge.pod_guard` refuses pods
that would override them). Kept free of imports so the webhook reads it without the
plugin's dependencies.
"""

from __future__ import annotations

from pathlib import PurePosixPath

CONTAINER_LIMITS_FILE = PurePosixPath("/etc/qgpu/limits.conf")  # the trusted limits file
CONTAINER_PRELOAD = PurePosixPath("/etc/ld.so.preload")  # names the interposer
CONTAINER_HOOK = PurePosixPath("/usr/local/qgpu/lib/libqgpu_hook.so")  # the interposer
CONTAINER_STATE_DIR = PurePosixPath("/run/qgpu/slices")  # the slice's ledger, its GPU's state

# Files the plugin bind-mounts one by one (a pod's own mount at the same path would win).
INJECTED_FILES = (CONTAINER_PRELOAD, CONTAINER_LIMITS_FILE, CONTAINER_HOOK)
# Directories whose whole subtree is the plugin's in the container.
INJECTED_DIRS = (CONTAINER_STATE_DIR,)
# What each injected path is, for the messages that name it.
PURPOSE = {
    CONTAINER_PRELOAD: "the interposer's preload",
    CONTAINER_LIMITS_FILE: "the slice's trusted limits file",
    CONTAINER_HOOK: "the interposer",
    CONTAINER_STATE_DIR: "the slice's ledger and its GPU's shared state",
}

# Environment the plugin sets for a slice: the device and the interposer's contract.
SLICE_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
SLICE_ENV_PREFIX = "QGPU_"
# NVIDIA's container toolkit reads this to decide which driver libraries a container gets;
# graphics, display (and all) bring Vulkan / OpenGL / EGL, which allocate device memory
# without libcuda, where no interposer sees it.
DRIVER_CAPABILITIES_ENV = "NVIDIA_DRIVER_CAPABILITIES"
UNSEEN_CAPABILITIES = ("graphics", "display", "all")
