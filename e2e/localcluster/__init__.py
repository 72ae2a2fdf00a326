"""The local control plane: real etcd, kube-apiserver, scheduler, controller-manager and kwok as
processes on loopback (controlplane), its certificates (pki), a small JSON API client (kapi), the
nodes and their labels (nodes), kwok's configuration and simulated kubelet (kwok_config, read from
the kwok-*.yaml files next to it) and local nodes whose pods run as processes (localnodes/, a
runtime of its own, started as `python -m shardwise.e2e.localcluster.localnodes`).

May import: shardwise.crds, shardwise.e2e.build
"""
