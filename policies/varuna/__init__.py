"""``policy=varuna``: restart from saved state after every membership change, morphed to the fastest configuration."""
