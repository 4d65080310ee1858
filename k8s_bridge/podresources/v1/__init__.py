"""Vendored kubelet podresources/v1 API (api.proto) and its generated gRPC stubs."""
