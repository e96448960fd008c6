"""weightsync-sglang: see README.md."""
