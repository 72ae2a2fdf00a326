"""kind clusters on real kubelets: Docker as kind needs it (docker), the images built from package
registries (images), the node image (nodeimage), a local registry (registry), the cluster (cluster),
and servers inside it (servers): an S3 server (objectstore) and a model registry (modelregistry).

May import: shardwise.crds, shardwise.e2e.build, shardwise.e2e.s3server, shardwise.e2e.localregistry
"""
