"""Rooms: one request's transfer on one local rank. The prefill side (targets planned, written,
reported) and the decode side (arrivals, claims on destinations, integrity), the registry and
their state machine; the ``Agent`` facade that holds them is ``pdfabric_agent.service``.
"""
