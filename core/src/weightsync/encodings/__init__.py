"""Built-in encodings."""
