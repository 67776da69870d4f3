"""The `k3export` command line (installed as the `k3export_cli` package; the library never imports it)."""
