"""This package trains the policy: the GRPO math (pure functions), the policy (a LoRA adapter on a
frozen base, its optimizer and folder), one GRPO update on it, the data-parallel step over several
processes, and the merge of an adapter into its base. Used by the train tasks (`grpo_flyte.trainer`)."""
