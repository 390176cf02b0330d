"""Starting runs: the command line, a local run's folder and a local sweep's, the checks before
anything starts, and a submission to a Flyte cluster."""
