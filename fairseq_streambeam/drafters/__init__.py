"""Drafters for aggressive decoding: produce a block of draft tokens per source."""
