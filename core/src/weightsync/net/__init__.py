"""HTTP plumbing shared by every weightsync service and client: the server, request bodies,
the guard against slow clients, API keys, the engine client and the body server."""
