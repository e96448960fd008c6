"""Fleets: where a sync's members come from, how they register, how one behind catches up."""
