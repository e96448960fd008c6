"""HTTP plumbing shared by every weightsync service and client: the server under each service,
request bodies as streams, the guard against slow and hostile clients, API keys, the client that
talks to engines, and the body server that receivers pull payload bodies from."""
