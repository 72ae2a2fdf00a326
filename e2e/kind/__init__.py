"""kind clusters on real kubelets: Docker as kind needs it (docker), the images built from package
registries (images), the node image (nodeimage), a local registry (registry), the cluster (cluster)
and an S3 server inside it (objectstore).

May import: shardwise.crds, shardwise.e2e.build, shardwise.e2e.s3server
"""
