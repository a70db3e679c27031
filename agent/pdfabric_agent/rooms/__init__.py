"""Rooms: one request's transfer on one local rank. The agent that holds them, the prefill side
(targets planned, written, reported) and the decode side (arrivals, claims on destinations,
integrity), the registry and their state machine.
"""
