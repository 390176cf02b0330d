"""This package holds the driver's parts: an iteration's batch, generation ahead of training, the
held-out evaluation, the guard, the metrics rows, the checkpointed loop state, who observes a run, a
local sweep's lockstep, and what a run publishes. Orchestration of the tasks; no torch."""
