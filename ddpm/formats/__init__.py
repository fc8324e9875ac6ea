"""The files a model lives in: their kinds, the checkpoint format and every file's metadata, the
U-Net's input/output spec, and the ONNX and TorchScript writers.
"""
