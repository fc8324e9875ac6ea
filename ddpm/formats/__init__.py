"""The files a model lives in: their kinds, the checkpoint format and every file's metadata, the
U-Net's input/output spec, the ONNX and TorchScript writers, and the TensorRT engine cache's rules (which
build each TensorRT version gets, the cache key, the metadata file beside an engine).
"""
