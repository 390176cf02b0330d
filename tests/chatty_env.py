"""A custom environment for the tests (`--env chatty_env:Chatty`): it answers every model turn
until the third, whatever the model says, so a random tiny model still plays multi-turn episodes."""

from grpo_flyte import MultiTurnEnv, Reply


class Chatty(MultiTurnEnv):
    stop = tuple(" etaoinsr")  # the random tiny model's turns end within a token or two

    def reset(self, example):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        if self.turns == 3:
            return Reply(done=True, reward=len(text) % 3 / 2)  # rewards that differ within a group
        return Reply(f"turn {self.turns}: go on", role="user")
