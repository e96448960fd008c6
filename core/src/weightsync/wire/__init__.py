"""What travels and how it is checked: Buckets, the frames that carry payloads (safetensors layout
inside), digests (xxh3, mlh), signing, and the worker pool and compiled loops digests run on."""
