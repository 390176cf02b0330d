"""This package starts runs: the command line, a local run (its folder, lock, log and stop) and a
local sweep, the checks before anything starts, and a submission to a Flyte cluster."""
