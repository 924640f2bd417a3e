"""Training data and drafter training.

- `moaspec.train.sharegpt`: ShareGPT conversations (tolerant parse of the truncated file) with
  benchmark prompts (MT-bench, HumanEval, ChatRAG) excluded. Pure Python, no torch.
- `moaspec.train.distill`: self-distillation, the target regenerates the responses into
  resumable jsonl shards.

Nothing is imported here, so `moaspec data ...` can validate its input before torch loads.
"""
