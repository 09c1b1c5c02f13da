"""Engines under test: the protocol, the reference, torch and planted-fault engines (faults.py; mistakes.py: the
diagnosis's known mistakes), honest variants of the reference (honest.py), and the choice among them."""
