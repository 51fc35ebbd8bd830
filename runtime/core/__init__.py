"""The contract and what it speaks of: jobs, changes and decisions, plans, instruction programs, the 1F1B scheduler,
the program checker, the cost model, model and device specs, the snapshot layout, the settings. Torch-free, and
importing nothing else of the runtime: policies, the coordinator, both backends and the machine models share it."""
