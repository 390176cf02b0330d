"""This package holds the process's machinery, beneath everything else: files written whole, the
cache folder, task storage (local paths and object stores), the one torch thread and its allocator,
child processes, the reward sandbox, the device probe and the peak memory of a span of work. No
module here imports torch at import time."""
