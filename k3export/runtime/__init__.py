"""k3export.runtime."""
