"""Child objects of a PDCluster, as plain dicts: pure functions of (cluster, spec, placement).

Every child carries the same labels and a controller ownerReference to its PDCluster, so the
garbage collector removes whatever the finalizer's cleanup misses, and names are deterministic
(a function of cluster and node), so a reconcile interrupted half-way and run again converges
instead of duplicating.

By child, each module pure (no kopf, no Kubernetes client; .importlinter's pure-operator contract):

- names.py: the owning cluster (``ClusterRef``), every child's deterministic name, labels, metadata;
- agent_pod.py: the node pods (one per placement unit), their resources and the hashes that say
  when a pod must be replaced;
- pod_spec.py: what every pod the operator builds shares: the restricted security context and the
  user's pod overrides, merged after the operator's entries;
- rankmap.py: the rank map and its ConfigMap, the ranks annotation;
- credentials.py: the engine token, the peer CA and each agent's peer certificate Secrets;
- services.py: the agents' headless Service, the engines' Services and endpoints, the NetworkPolicy;
- router.py: spec.router's Deployment and Service.
"""
