"""Built-in compressors."""
