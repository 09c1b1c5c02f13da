"""Engines under test: the protocol, the reference, torch and planted-fault engines, and the choice among them."""
