"""Small helpers every layer uses: safe files, signals, messages, the precision policy, the memory
budget, profiling, the torchrun layer and the extension's compiler flags.
They import nothing above them.
"""
