"""``protection=storage``: periodic checkpoints to storage, the state every restart-based recovery relies on."""
