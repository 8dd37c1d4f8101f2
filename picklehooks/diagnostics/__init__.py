"""Debugging workflows built on the logs."""
