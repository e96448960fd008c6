"""weightsync-megatron: see README.md."""

__version__ = "0.2.0"   # the one source: hatch reads it for the distribution's version
