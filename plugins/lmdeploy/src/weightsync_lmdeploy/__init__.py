"""weightsync-lmdeploy: see README.md."""
