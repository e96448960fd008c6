from weightsync.cli import main

raise SystemExit(main())
