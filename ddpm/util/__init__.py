"""Small helpers every layer uses: safe files, signals, messages, the precision policy, the memory
budget, profiling and the torchrun layer.
They import nothing above them.
"""
