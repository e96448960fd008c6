"""Built-in transports."""
