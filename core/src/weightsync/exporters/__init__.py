"""Built-in exporters."""
