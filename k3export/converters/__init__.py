"""k3export.converters."""
