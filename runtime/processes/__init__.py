"""The process backend: the local and remote launchers, node agents, workers, the instruction executor,
communication, ZeRO-1 and the layer profiler, all on real processes."""
