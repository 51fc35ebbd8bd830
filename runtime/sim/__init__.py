"""The simulator: the coordinator's protocol carried out in simulated time on a machine model. The process backend's
twin; neither imports the other."""
