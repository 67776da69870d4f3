"""k3export.ops."""
