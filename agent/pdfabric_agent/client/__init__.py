"""The engine-side client of the agent's engine door (serving engines, the SGLang plugin, tests):
typed requests over a keep-alive HTTP/1.1 connection, pools mapped into the caller.
"""
