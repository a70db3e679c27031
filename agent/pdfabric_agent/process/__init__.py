"""The agent process: settings, rank map, hardware and transport, pools, the doors, the engines it
supervises, the tick (``main``).
"""
