"""Training drafters."""
