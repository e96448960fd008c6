"""weightsync-disk-delta: see README.md."""
