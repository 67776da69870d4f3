"""k3export.validate."""
