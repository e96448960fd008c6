"""A tensor's digest in a hash state the compiled loops can feed themselves: this is
`weightsync.wire.digests` (core), shared with core's one-pass copy + digest; this module name stays
for the plugin's own imports and tests.

The module object *is* core's (`sys.modules` points this name at it), so `Digest`, `library()`,
`update_address()` and the `_lib`/`_loaded` switches a test may patch are one and the same."""

from __future__ import annotations

import sys

from weightsync.wire import digests as _core
sys.modules[__name__] = _core
