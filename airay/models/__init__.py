"""Example models for airay jobs: small, plain, readable top to bottom."""
