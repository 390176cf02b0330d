"""`python -m grpo_flyte` (and `python -m grpo_flyte.driver`): the command line in `grpo_flyte.cli`."""

from grpo_flyte.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
