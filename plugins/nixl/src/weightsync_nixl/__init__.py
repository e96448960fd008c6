"""weightsync-nixl: transport `nixl` and peer source `nixl` (see README.md). Nothing here imports
NIXL; the modules that move bytes load it on first use (`weightsync_nixl.loader`)."""

__version__ = "0.2.0"   # the one source: hatch reads it for the distribution's version
