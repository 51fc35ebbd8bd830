"""``policy=elastic``: torchft-style elastic data parallelism: drop the replicas that lost a worker, heal new ones."""
