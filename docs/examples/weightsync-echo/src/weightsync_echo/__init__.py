"""weightsync-echo: a transport that carries payloads through files in a local directory."""
