"""nvlink-proxy sidecar: the in-pod KV copy service (`pdunit proxy`)."""
