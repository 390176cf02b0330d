"""A custom environment for the tests (`--env chatty_env:Chatty`): it answers every model turn
until the third, whatever the model says, so a random tiny model still plays multi-turn episodes."""

from grpo_flyte import MultiTurnEnv, Reply


class Chatty(MultiTurnEnv):
    stop = tuple(" etaoinsr")  # the random tiny model's turns end within a token or two
    last_turn = 3  # the model turn whose step ends the episode

    def reset(self, example):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        if self.turns == self.last_turn:
            return Reply(done=True, reward=len(text) % 3 / 2)  # rewards that differ within a group
        return Reply(f"turn {self.turns}: go on", role="user")


class Broken(Chatty):
    """Every step raises: each stepped turn is a tool error the model is told about."""

    def step(self, text):
        raise RuntimeError("the tool is broken")


class Slow(Chatty):
    """Every step sleeps past --tool-timeout-s: each is a tool error too."""

    def step(self, text):
        import time

        time.sleep(3)
        return super().step(text)


class Stringly(Chatty):
    """A step that returns a plain string instead of a Reply: a bug in the environment."""

    def step(self, text):
        return "just text"


# A page of prose: what a tool that fetches a web page or reads a file returns (~4,500 tokens).
PAGE = ("The quick brown fox jumps over the lazy dog while the river runs past the mill. " * 250)[:20_000]


class Pages(Chatty):
    """Every reply is a 20,000-character page: each turn adds thousands of tokens to the context."""

    page = PAGE

    def step(self, text):
        reply = super().step(text)
        return reply if reply.done else Reply(self.page, role="user")


class Prose(Pages):
    """Three replies of 8,000 characters of prose an episode, the fourth turn ends it (`--max-turns 4`):
    issue 55's multi-turn memory case (benchmarks/memory.py's `multiturn` run)."""

    last_turn = 4
    page = PAGE[:8_000]
