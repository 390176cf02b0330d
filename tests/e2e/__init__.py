"""End-to-end runs, the pod rehearsal, the report in a browser and the vLLM contract: real processes, slow."""
