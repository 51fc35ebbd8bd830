"""``policy=adaptive``: per membership change, the recovery (reroute, reconfigure, restart) with the lowest predicted
cost."""
