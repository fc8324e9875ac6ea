"""Running a U-Net to sample: the implementation registry, loading any model file, onnxruntime and
TorchScript, OpenVINO.
"""
