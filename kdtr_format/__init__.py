"""The .kdtr container: spec constants, reader, writer, errors, INT4 layout (see docs/kdtr-format.md)."""
