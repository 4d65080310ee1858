"""Vendored kubelet deviceplugin/v1beta1 API (api.proto) and its generated gRPC stubs."""
