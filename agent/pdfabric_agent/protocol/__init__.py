"""The agent's language: the engine door's and the peer door's messages, their bounded fields, the
refusals, the closed label sets, and the peer door's TLS identity.
"""
