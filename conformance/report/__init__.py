"""Reports of a verdict: the verdict itself, coverage, console, JSON, JUnit and HTML."""
