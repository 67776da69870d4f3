"""k3export.converters.onnx."""
