"""The agent's HTTP surface: the engine door, the peer door and the metrics port; the bounds on
every listener (heads, bodies, connections, TLS handshakes) and bounded JSON.
"""
