"""The serving engines of a node pod (spec.engine): which engines run where, how each is launched,
and how it is doing. The one place for these facts; the operator builds pods and Services from
them, the agent supervises processes by them, and both read the same status message.

The pod shape (docs/engines.md says why): one container per node pod holds every GPU of the
node's ranks (the device plugin's grant), runs the agent, and the agent runs one engine process
per group of ranks (one replica of one role placed on the node) with CUDA_VISIBLE_DEVICES naming
that group's GPUs. The operator hands the agent its engines as ``EngineLaunch`` messages in the
container's ``PDFABRIC_ENGINES`` variable; the agent answers with ``EngineState`` in /readyz.

The k-th engine of a role in the pod serves on ``port + k`` (prefill's bootstrap server on
``bootstrapPort + k``): engines of one pod share its network namespace.

By concern:

- launch.py: the launch message (``EngineLaunch``), the variables every engine gets (``EngineEnv``),
  ``PDFABRIC_ENGINES``' encoding and the kubelet's $(VAR) expansion;
- groups.py: which engines a node's ranks make (``EngineGroup``), their ports, and their launch
  messages from the spec (``engine_launches``, ``hoisted_env``);
- state.py: how an engine is doing (``EngineState``, in the agent's /readyz);
- router.py: SGLang's PD router's worker arguments from ``status.endpoints``.
"""
