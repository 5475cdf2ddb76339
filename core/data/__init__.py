"""Bundled public datasets (package data)."""
