"""The model as workers train it: model families, forward and backward passes, the optimiser, layer state, data, and
the steady host allocator of a computing process."""
