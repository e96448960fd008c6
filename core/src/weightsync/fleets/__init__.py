"""Fleets: where a sync's members come from (a static list, a registry members join at run
time), how members register themselves, and how a member that is behind catches up from a peer."""
