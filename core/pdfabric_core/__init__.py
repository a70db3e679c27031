"""PD semantics shared by the operator and the agent.

Everything here is pure: no kopf, no kubernetes client, no torch, no engine. Each upstream PD rule
(rank mapping, CP-replicated state dedup, aux path, metadata-buffer device, page coalescing, batch
chunking) lives in exactly one module under ``policy/`` and every backend calls it.
"""
