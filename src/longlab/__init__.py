"""longlab."""
