"""kind clusters on real kubelets: Docker as kind needs it (docker), the images built from package
registries (images), the node image (nodeimage), a local registry (registry) and the cluster (cluster).

May import: shardwise.crds, shardwise.e2e.build
"""
