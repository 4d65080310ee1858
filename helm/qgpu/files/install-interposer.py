"""install-interposer (init container of qgpu-manager): copy the image's libqgpu_hook.so to
the host directory that workload containers get it bind-mounted from.

The copy replaces the old file atomically (a new inode): containers running with the old
library keep their bind mount of it, new containers get the new one.
"""

import os
import shutil

from enforcement.native import hook_library_path

target_dir = os.environ["QGPU_INTERPOSER_DIR"]
os.makedirs(target_dir, exist_ok=True)
target = os.path.join(target_dir, "libqgpu_hook.so")
tmp = os.path.join(target_dir, f".libqgpu_hook.so.{os.getpid()}")
shutil.copyfile(hook_library_path(), tmp)
os.chmod(tmp, 0o755)
os.replace(tmp, target)
print(f"installed {target}")
