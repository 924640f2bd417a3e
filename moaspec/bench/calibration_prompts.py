"""The prompts `moaspec tune` calibrates a drafter's acceptance on (bench/tune.py), apart from it so
that `tune`'s flags are checked against their number without importing torch."""

CALIBRATION_PROMPTS = (  # written for calibration; not from any benchmark set
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a short Python function that counts the vowels in a string, with a docstring.",
    "Give me three tips for learning a new language as an adult.",
    "Describe a quiet morning in a small coastal town in one paragraph.",
    "What is the difference between weather and climate?",
    "List five healthy snacks and say why each one is good for you.",
)
