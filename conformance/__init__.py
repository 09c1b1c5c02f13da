"""Conformance runner: metrics, tolerances, localisation, token streams, reports."""
