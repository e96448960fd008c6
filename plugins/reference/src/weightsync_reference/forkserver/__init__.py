"""A fork server for engine starts. A start of `python -m weightsync serve` spends about 3 s of
CPU importing torch before it serves a byte; a test suite starts hundreds. The fork server is one
process that imports torch, weightsync and the installed plugins once and then forks each start
it is sent, so a start costs a fork. The suite's conftest runs one per pytest process and names
its socket in `WEIGHTSYNC_FORKSERVER`; `popen` sends a start there when the fork server can run
it exactly as a fresh interpreter would, and starts anything else with `subprocess.Popen`."""

from weightsync_reference.forkserver.client import ENV, ForkedProcess, popen, serving

__all__ = ["ENV", "ForkedProcess", "popen", "serving"]
