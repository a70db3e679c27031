"""Talking to peer agents: the mutual-TLS session with typed messages, and each peer's health
(blacklist, probes, heartbeats, blame).
"""
