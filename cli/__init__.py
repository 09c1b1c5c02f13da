"""The `kdtr` command: thin click wrappers over library functions."""
