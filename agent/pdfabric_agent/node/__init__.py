"""What this node can carry: its hardware, the transport chosen for it, and the link check run
before Ready.
"""
