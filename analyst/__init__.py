"""fedpca analyst role."""
