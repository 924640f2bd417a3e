"""`moaspec bench` and `moaspec tune`: measure decoding methods side by side, tune the draft tree.

Modules, one job each: prompts (benchmark sets), methods (what is compared), runner (the
interleaved protocol), memory (per-method RSS), report (aggregation, results.json, results.md),
schema (results.json validation), plots (PNG), output (atomic writes), machine (the machine a run
is on), tune (`moaspec tune`: rank rates and the measurement run), cli (the commands);
`--client-server`: client_server (flags, report), client_server_runner (protocol and metrics),
client_server_cases (the measured clients and servers). Cycle costs and the tree ranking are in
moaspec/calibration; the tuned-tree store that generation reads lives in moaspec/tuned.py.
Kept free of heavy imports so the CLI can validate flags before torch loads.
"""
