"""The communicator: the world, its ring and process sets, and the collectives over numpy arrays."""
