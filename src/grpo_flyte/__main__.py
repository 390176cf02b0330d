"""`python -m grpo_flyte` (and `python -m grpo_flyte.driver`) runs the command line in `grpo_flyte.launch.cli`."""

from grpo_flyte.launch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
