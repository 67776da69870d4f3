"""k3export.converters.tensorrt."""
