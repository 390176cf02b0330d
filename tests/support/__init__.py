"""Helpers the tests import (`from tests.support import warm_python`) or start as scripts by file path."""

from pathlib import Path

# This folder: the scripts the tests start by file path (kill_drill.py, vllm_contract.py, ...), and
# the module chatty_env, which runs import by name (`--env chatty_env:Chatty`) with it on sys.path.
SUPPORT = Path(__file__).resolve().parent
