"""Training data: the dataset catalog, loading it, 3-D volumes, and the sample files (PNG grid, .npz)."""
