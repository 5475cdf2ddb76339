"""fedpca proxy role."""
