"""``policy=bamboo``: redundant computation: each node keeps its successor's stage, and takes it over when it fails."""
