"""The local control plane: real etcd, kube-apiserver, scheduler, controller-manager and kwok as
processes on loopback (controlplane), its certificates (pki), a small JSON API client (kapi), kwok's
simulated kubelet (kwok_stages) and local nodes whose pods run as processes (localnodes).

May import: shardwise.crds, shardwise.e2e.build
"""
