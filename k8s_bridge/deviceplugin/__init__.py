"""Device plugin (kubelet deviceplugin/v1beta1): qgpu-core and qgpu-memory for one node."""
