"""k3export.converters.checkpoints."""
