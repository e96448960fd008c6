"""weightsync-vllm: see README.md."""
