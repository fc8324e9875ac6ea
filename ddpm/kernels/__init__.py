"""The diffusion_kernels extension from Python: how it is compiled (build.py: the flags setup.py and the JIT build
share), and its ops (ops.py: loading the extension, the fake kernels torch.compile traces, a wrapper per op). The
kernels are the C++/CUDA sources at the root; the "cuda" implementation that runs them is optimized_diffusion.py.
"""
