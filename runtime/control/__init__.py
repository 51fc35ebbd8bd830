"""The protocol: the coordinator's two-phase commit, the backend seam it drives (failures as values) and the event
vocabulary every subscriber reads. Above the contract, below both backends."""
