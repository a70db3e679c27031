"""Moving bytes: the backend interface, the registry of engine backends by name (Mooncake, MORI)
and the NVLink fast path over them. Nothing here knows of rooms, peers or the wire.
"""
