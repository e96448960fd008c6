"""Built-in adapters."""
