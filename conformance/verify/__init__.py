"""The judge: collect an engine's outputs, validate them, judge taps, tokens and DDTree, localize (`kdtr verify`)."""
