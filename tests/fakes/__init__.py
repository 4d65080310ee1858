"""In-repo fakes of Kubernetes components (kubelet device-plugin side, apiserver)."""
