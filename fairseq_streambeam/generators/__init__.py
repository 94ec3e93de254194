"""Generators composed from search, runtime and scorers."""
