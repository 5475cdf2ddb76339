"""fedpca owner role."""
