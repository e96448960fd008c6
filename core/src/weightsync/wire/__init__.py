"""What travels and how it is checked: Buckets, the frames that carry payloads (safetensors
layout inside), digests (xxh3 and mlh), signing, and the worker pool and compiled loops the
digests run on."""
