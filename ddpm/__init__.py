"""Everything around the design's core modules (main.py, noise_schedule.py, basic_diffusion.py,
optimized_diffusion.py, tensorrt_integration.py at the repository root), one folder per concern.

Imports flow one way: util/ at the bottom; formats/, data/, latent/, kernels/ and conditioning.py; backends/,
training/, evaluation/ and benchmarks/; then modes/; then cli/ and main.py. The README's
"How it is built" shows the tree.
"""
