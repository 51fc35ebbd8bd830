"""What a job reports: the MLflow tracker, the progress line, the timeline figure and the fault ledger."""
