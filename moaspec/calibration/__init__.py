"""Machine calibration: on first use on a machine, measure what decides speed there and choose
the weight layout, drafter form, tree and lookup trie by predicted tokens/s (plan.py).

Modules, one job each: machine (CPU and runtime identity), profile (stored, machine-independent
acceptance; lookup replay), costs (measuring one cycle's costs), costs_store (measured costs,
cached per machine), tree_ranking (acceptance model, trees ranked by expected tokens/s), predict
(tokens/s of each option, the choice rule), plan (the whole procedure, applied to a target and
drafter), busy_machine (a generation's note when it decoded far slower than predicted).
"""
