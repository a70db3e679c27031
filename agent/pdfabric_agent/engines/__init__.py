"""The serving engines of a node pod (spec.engine): how each is launched and sandboxed, and the
supervisor that runs and watches them.
"""
