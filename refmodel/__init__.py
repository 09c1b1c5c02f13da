"""The NumPy float64 reference (oracle) for Kimi K2.6-class models. Imports nothing but numpy."""
