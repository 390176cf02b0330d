"""This package generates: the transformers and vLLM generators behind one interface, the engine
cache and the replica's batching in front of them, our decode loop (sampling, stop strings, the
grammar, the prefix cache), mixed LoRA batches, multi-turn episodes and prompts.

Used by the generate and judge tasks; torch, transformers and vLLM are imported inside, when an
engine is built."""
