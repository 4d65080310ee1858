"""Vendored kubelet APIs other than the device plugin's (the pod-resources API)."""
