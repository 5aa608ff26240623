"""Built-in aggregators (distributed algorithms)."""
