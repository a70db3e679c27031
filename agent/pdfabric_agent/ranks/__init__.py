"""The ranks this agent serves: each one's backend and memory (the agent's pools, or the buffers
its engine registered), and where the rank map puts the others.
"""
