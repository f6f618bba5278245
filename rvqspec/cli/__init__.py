"""The `rvqspec` command line: the entry point (`main`), the shared flags and one module per command."""
