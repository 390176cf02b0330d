"""Run the CLI and SIGKILL it at one named point: tests/unit/launch/test_run_folder.py's kill drill.

    python tests/support/kill_drill.py POINT N <cli arguments...>

dies at the Nth time POINT is reached. A POINT is either
- a file or folder name that is about to be renamed into place (every whole-file write and every
  published folder ends in os.replace): 'config.json', 'metrics.jsonl', 'report.html',
  'checkpoint', 'iter-0000.jsonl', 'v0002', 'adapter'; the process dies with the temporary
  file or staging folder written and the rename not done;
- 'generate' (an engine batch), 'train' (a GRPO step, before it starts) or 'save_adapter'
  (inside it: the adapter weights written, the optimizer state not yet).
"""

from __future__ import annotations

import os
import signal
import sys

from grpo_flyte.engine import batching
from grpo_flyte.launch import cli
from grpo_flyte.learning import policy
from grpo_flyte.learning import update as policy_update

point, nth, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
seen = 0


def reached(name: str) -> None:
    global seen
    if name == point:
        seen += 1
        if seen == nth:
            os.kill(os.getpid(), signal.SIGKILL)


replace = os.replace


def replace_or_die(src, dst, *a, **kw):
    reached(os.path.basename(os.fspath(dst)))
    return replace(src, dst, *a, **kw)


os.replace = replace_or_die

generate_groups = batching.generate_groups


async def generate_or_die(*a, **kw):
    reached("generate")
    return await generate_groups(*a, **kw)


batching.generate_groups = generate_or_die
grpo_step, save_adapter = policy_update.grpo_step, policy.save_adapter


def grpo_step_or_die(*a, **kw):
    reached("train")
    return grpo_step(*a, **kw)


def save_adapter_or_die(model, optimizer, version, out, *rest):
    model.save_pretrained(str(out))
    reached("save_adapter")
    return save_adapter(model, optimizer, version, out, *rest)


policy_update.grpo_step, policy.save_adapter = grpo_step_or_die, save_adapter_or_die
# Only the drill's own process runs the CLI (a script that another process imports stays inert).
if __name__ == "__main__":
    sys.exit(cli.main(args))
