"""k3export.plugins."""
