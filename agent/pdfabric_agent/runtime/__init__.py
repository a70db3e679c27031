"""What the agent process runs on: its settings from the environment, its Prometheus metrics, and
its event loop's tasks and liveness.
"""
