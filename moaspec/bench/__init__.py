"""`moaspec bench` and `moaspec tune`: measure decoding methods side by side, tune the draft tree.

Modules, one job each: prompts (benchmark sets), methods (what is compared), runner (the
interleaved protocol), memory (per-method RSS), report (aggregation, results.json, results.md),
schema (results.json validation), plots (PNG), output (atomic writes), costs (measured cycle
costs), tune (acceptance model and tree ranking), cli (the commands). The tuned-tree store that
generation reads lives in moaspec/tuned.py.
Kept free of heavy imports so the CLI can validate flags before torch loads.
"""
