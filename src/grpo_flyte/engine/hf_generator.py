"""This module is the transformers backend's engine: PEFT adapters on the base model, decoded by our
own loop (`decode_loop`).

One adapter is active at a time and a few are kept loaded; a batch of several adapters' rows runs
every row's base layers in one batch and its LoRA layers with its adapter (PEFT's mixed adapter
batches, `mixed_lora`). The engine keeps the key/value caches of the current adapter's unfinished
multi-turn contexts (`prefix_cache.PrefixCache`), so an episode's next turn computes only the
environment's reply, and bounds the key/value cache one decode batch holds.
"""

from __future__ import annotations

from collections import OrderedDict

from grpo_flyte.config.training import CPU_MICRO_BATCH_TOKENS
from grpo_flyte.engine import mixed_lora
from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.errors import AdapterError
from grpo_flyte.models.attention import set_attention
from grpo_flyte.models.gguf_writer import gguf_in
from grpo_flyte.models.loading import share_frozen_weights
from grpo_flyte.runtime import allocator
from grpo_flyte.runtime.device import best_device, torch_dtype
from grpo_flyte.types import Rollout

# The transformers engine's store of multi-turn contexts' key/value caches (prefix_cache.PrefixCache): about
# the embedded model's own size (fp32), ~11,000 context tokens of it (46 KB each: 30 layers x K and V
# x 3 heads x 64 x 4 bytes); past it the oldest contexts are recomputed, not kept.
PREFIX_CACHE_BYTES = 512 * 2**20
# The key/value cache one decode batch of the transformers engine may hold (rows x their longest
# context and new tokens): rows past it decode in further batches, one after another, so that the
# memory of generation is this bound, not the batch's (64 episodes of 7,000-token contexts hold
# 10 GB on the embedded model in bfloat16). Runs of short contexts (an iteration of a default run
# is ~17,000 tokens, 0.4 GB) decode in one batch as before.
DECODE_BATCH_KV_BYTES = 2**30
# The prefix cache's owner while a batch mixes adapters: no context is kept across it.
MIXED_ADAPTERS = "<several adapters>"


def cut_at_eos(token_ids: list[int], logprobs: list[float], eos_ids: set[int]) -> tuple[list[int], list[float], str]:
    """Keep tokens up to and including the first EOS; what follows is padding."""
    for i, tok in enumerate(token_ids):
        if tok in eos_ids:
            return token_ids[: i + 1], logprobs[: i + 1], "stop"
    return token_ids, logprobs, "length"


class HFGenerator:
    """transformers + PEFT generation; one adapter active at a time, a few kept loaded, and the
    cache of the current adapter's unfinished multi-turn contexts."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        max_adapters: int,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        batch_kv_bytes: int = DECODE_BATCH_KV_BYTES,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grpo_flyte.engine.prefix_cache import PrefixCache

        self.device = best_device()
        # an exported GGUF form (a folder holding one .gguf): the model, its tokenizer and its chat
        # template read from the file, by transformers' GGUF loader
        gguf = {"gguf_file": name} if (name := gguf_in(model_path)) is not None else {}
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, **gguf)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype), **gguf)
        set_attention(model, self.device)
        self.base = model.to(self.device).eval()
        share_frozen_weights(self.base, model_path, dtype)  # the trainer's copy in a local run
        self.model = None  # the PeftModel, once the first adapter is loaded
        self.adapters: OrderedDict[str, str] = OrderedDict()  # adapter path -> PEFT adapter name
        self.max_adapters = max_adapters
        self._next_name = 0
        eos = self.base.generation_config.eos_token_id
        self.eos_ids = {*(eos if isinstance(eos, list) else [eos] if eos is not None else []), self.tokenizer.eos_token_id}
        self.eos_ids.discard(None)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.prefixes = PrefixCache(prefix_cache_bytes)
        self.batch_kv_bytes = batch_kv_bytes
        self._grammar_tokenizer = None  # built on the first request with a regex (the judge's)

    def _matchers(self, regexes: list[str | None]) -> list | None:
        """Each batch row's `grammar.regex_matcher`, or None where a row has no regex (None: no row has one)."""
        from grpo_flyte.engine.grammar import grammar_tokenizer, regex_matcher

        if all(r is None for r in regexes):
            return None
        if self._grammar_tokenizer is None:
            vocab_size = self.base.get_output_embeddings().weight.shape[0]
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, vocab_size, self.eos_ids)
        return [None if r is None else regex_matcher(self._grammar_tokenizer, r) for r in regexes]

    def close(self) -> None:
        import gc

        del self.model, self.base, self.prefixes
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    def _activate(self, adapter_path: str) -> None:
        from peft import PeftModel

        if adapter_path in self.adapters:
            self.adapters.move_to_end(adapter_path)
            self.model.set_adapter(self.adapters[adapter_path])
            return
        name = f"adapter{self._next_name}"
        self._next_name += 1
        try:
            if self.model is None:
                self.model = PeftModel.from_pretrained(self.base, adapter_path, adapter_name=name, is_trainable=False)
            else:
                self.model.load_adapter(adapter_path, adapter_name=name, is_trainable=False)
        except Exception as exc:  # noqa: BLE001 -- a missing, truncated or foreign adapter fails in many ways
            if self.model is not None and name in self.model.peft_config:
                self.model.delete_adapter(name)  # nothing half-loaded stays in the warm engine
            raise AdapterError(f"adapter {adapter_path!r} cannot be loaded ({type(exc).__name__}: {exc})") from None
        self.model.set_adapter(name)
        self.model.eval()
        self.adapters[adapter_path] = name
        while len(self.adapters) > self.max_adapters:
            _, old = self.adapters.popitem(last=False)
            self.model.delete_adapter(old)
        mixed_lora.install(self.model)  # mixed batches in two matmuls a layer; drops stale stacks

    def generate_many(self, requests: list[SamplingRequest], adapter_path: str | None) -> list[list[Rollout]]:
        """One batched decode for several groups sharing an adapter (None: the base model, e.g.
        the judge) and sampling settings."""
        return self.generate_mixed(requests, [adapter_path] * len(requests))

    def generate_mixed(self, requests: list[SamplingRequest], adapter_paths: list[str | None]) -> list[list[Rollout]]:
        """One batched decode for several groups sharing sampling settings, each with its own
        adapter (`adapter_paths[i]` for `requests[i]`): with several, PEFT's mixed adapter batches
        run every row's base layers in one batch and its LoRA layers with its adapter. Several
        adapters need at most `max_adapters` of them, no multi-turn context to keep and no regex."""
        import contextlib

        import torch

        from grpo_flyte.engine.decode_loop import DecodeCall, decode
        from grpo_flyte.engine.prefix_cache import kv_bytes_per_token
        from grpo_flyte.engine.sampling import hits_stop
        from grpo_flyte.learning.grpo import plan_micro_batches

        distinct = list(dict.fromkeys(adapter_paths))
        mixed = len(distinct) > 1
        if mixed:
            assert None not in distinct and len(distinct) <= self.max_adapters, "a mixed batch's adapters must fit the engine"
            assert not any(r.continues or r.regex for r in requests), "multi-turn contexts and regexes batch per adapter"
            for path in distinct:
                self._activate(path)
        adapter_path = distinct[0] if not mixed else None
        if adapter_path is not None:
            self._activate(adapter_path)
        model = self.model if mixed or adapter_path is not None else self.base
        # the base model's layers hold the loaded adapters (PEFT injects them): off for a None adapter
        no_adapter = adapter_path is None and not mixed and self.model is not None
        base_only = self.model.disable_adapter() if no_adapter else contextlib.nullcontext()
        # None: the base model's contexts; a mixed batch keeps none (they would be another adapter's)
        self.prefixes.use(MIXED_ADAPTERS if mixed else adapter_path)
        names = (
            [self.adapters[path] for r, path in zip(requests, adapter_paths, strict=True) for _ in range(r.group_size)] if mixed else None
        )
        prompts = [r.prompt_ids for r in requests for _ in range(r.group_size)]
        seeds = [(r.seed, row) for r in requests for row in range(r.group_size)]
        owners = [r for r in requests for _ in range(r.group_size)]  # each batch row's request
        continued = frozenset(i for i, r in enumerate(owners) if r.continues)
        sampling = requests[0].sampling()
        call = DecodeCall(
            seeds=seeds,
            sampling=sampling,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            tokenizer=self.tokenizer,
            prefixes=self.prefixes,
            continued=continued,
            matchers=self._matchers([r.regex for r in owners]),
            adapter_names=names,
        )
        rows: list = [None] * len(prompts)
        token_bytes = kv_bytes_per_token(self.base)
        lengths = [len(p) + sampling.max_new_tokens for p in prompts]
        # a context longer than a train micro-batch (a long observation's) keeps none of its memory after
        long = allocator.handing_back(max(lengths, default=0) > CPU_MICRO_BATCH_TOKENS, mmap_large_blocks=False)
        with long, torch.inference_mode(), base_only:
            # within the cache bound, in batches of similar lengths (the trainer's micro-batch plan)
            for part in plan_micro_batches(lengths, max(1, self.batch_kv_bytes // token_bytes)):
                part.sort()
                decoded = decode(model, [prompts[i] for i in part], call.rows(part))
                for i, row in zip(part, decoded, strict=True):
                    rows[i] = row
        rollouts = []
        ends = self.eos_ids | set(sampling.stop_token_ids)
        for ids, lps in rows:
            ids, lps, finish = cut_at_eos(ids, lps, ends)
            if finish == "length" and hits_stop(self.tokenizer, ids, sampling.stop):
                finish = "stop"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            rollouts.append(Rollout(completion_ids=ids, sampling_logprobs=lps, finish_reason=finish, text=text))
        groups, start = [], 0
        for r in requests:
            groups.append(rollouts[start : start + r.group_size])
            start += r.group_size
        return groups
