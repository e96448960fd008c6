"""`python -m weightsync_reference.forkserver SOCKET`: serve starts on SOCKET until SIGTERM."""

import sys

from weightsync_reference.forkserver.server import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
