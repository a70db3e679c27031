"""How a rank's bytes are laid out and reached: pool layouts and allocation, transfer plans over
them, completion words, and the CUDA driver and IPC helpers.
"""
