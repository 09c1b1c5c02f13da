"""Conformance: gen/ makes golden bundles, verify/ judges an engine against one, engines/ holds the engines
under test, report/ writes the verdict; the modules here (tolerance, records, metrics, precision, exit codes)
are what those share (docs/architecture.md)."""
