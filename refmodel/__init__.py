"""The NumPy float64 reference (oracle) for Kimi K2.6-class models. Imports numpy, the standard library
and kdtr_format only; torch only in refmodel/distill.py, imported when a drafter is distilled."""
