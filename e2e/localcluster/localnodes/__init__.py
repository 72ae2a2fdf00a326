"""Local nodes: Node objects whose pods run as processes on this machine.

A development runtime, not a kubelet. It lets the operator and the real worker run together on one
machine without containers. One process (started by `shardwise dev up --local-nodes K`) serves every
Node labelled `shardwise.dev/local-node=true` that is not labelled `shardwise.dev/node-down=true`:

- keeps the node alive: renews its Lease in kube-node-lease and writes its Ready condition;
- for each pod bound to it: gives the pod its own loopback IP (status.podIP, env POD_IP), writes its
  ConfigMap/Secret volumes into a per-pod folder (written again when the pod's labels or
  annotations change, as a kubelet's sync of an updated pod does), and runs each container's command + args as a
  process (own process group) with the container's env; stdout/stderr go to
  <state>/pods/<namespace>_<pod>/<container>.log;
- reports phase, container states, restartCount and readiness (the container's readinessProbe:
  httpGet, tcpSocket or exec) to the API server; restarts exited containers per restartPolicy;
  livenessProbe failures restart the container;
- kills a pod's processes when the pod is deleted (SIGTERM, then SIGKILL after the grace period),
  when its node is deleted or marked down, and when this runtime stops.

What a container sees, since there is no image and no mount namespace:
- mountPath of a volume is rewritten to the materialised folder wherever it appears as a whole path
  (not inside a longer path or a URL such as s3://checkpoints/tiny) in command, args,
  env values and the files of ConfigMap volumes, a gzip-compressed one inside and recompressed
  (`/etc/shardwise/contract.json.gz` -> `<state>/pods/ns_pod/volumes/plan/contract.json.gz`; the
  worker's pod contract in that file names the model, data and checkpoint paths inside the pod);
  a pod's own hostPath volume is a folder of its node, <state>/nodes/<node>/hostpath/<path> (made
  for any type but File/Socket/CharDevice/BlockDevice), so node-local storage is local to the node:
  pods on other nodes do not see it, a pod on the same node later does, and deleting the Node
  deletes that folder (its disk is gone; a node marked down keeps it, as a rebooted one would);
  a PersistentVolumeClaim bound to a hostPath or local PersistentVolume is that folder of this
  machine (shared by every pod on every node that mounts it, as a ReadWriteMany volume is);
- the terminationMessagePath (default /dev/termination-log) is rewritten the same way to a file of
  the container's own (in a ConfigMap's files: of the pod's first container declaring that path);
  what the process writes there (or, with FallbackToLogsOnError, the tail of
  its log when it failed) is reported as the terminated state's message;
- there is no cluster DNS: `<hostname>.<subdomain>.<namespace>.svc[.cluster.local]` in args and env
  values is rewritten to the IP of the pod with that hostname and subdomain, and
  `<service>.<namespace>.svc[.cluster.local]` to the IP of a Ready pod behind that Service; the
  container starts only once every such name resolves (as a real pod would retry DNS);
- the environment is the runtime's own (PATH, HOME, ...) plus the container's env.
Not done: images, resource limits (no cgroups), network isolation (ports are shared; bind to
POD_IP), startupProbe, exec/logs/port-forward through the API, emptyDir size limits, claims bound
to other kinds of volume, readOnly mounts (nothing stops a process writing there).

Its modules: the process that serves the nodes (__main__), this machine as their host
(host: which nodes it serves, every pod seen, one runner per pod of theirs), the node heartbeat
(heartbeat), a node's disk (nodedisk), pod IPs (ips), name resolution in place of cluster DNS (dns),
one pod's lifecycle (pods), what its containers see (podenv, volumes), their processes (containers),
their probes (probes) and the pod status reported (podstatus).

May import: shardwise.e2e.localcluster.kapi, shardwise.e2e.localcluster.nodes, shardwise.crds.compressed
"""
