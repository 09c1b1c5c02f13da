"""The judge: collect an engine's outputs, validate them, judge taps, tokens and DDTree, localize, diagnose
(`kdtr verify`)."""
