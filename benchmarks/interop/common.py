"""Inputs shared by the two sides of the interop checks (each side runs in its own environment)."""

SENTENCES = [
    "The cat sits on the mat.", "A dog plays in the park with a red ball.",
    "Quantized weights make large language models cheaper to serve.", "Paris is the capital of France.",
    "The stock market fell sharply on Monday morning.", "She plays the violin in an orchestra.",
    "Photosynthesis converts light into chemical energy.", "How do I reset my password?",
    "The train to Berlin leaves at seven.", "Rain is expected for most of the week.",
    "He fixed the bug by checking the array bounds.", "The museum opens a new exhibition of modern art.",
    "Coffee contains caffeine, a mild stimulant.", "Mountains cover a large part of Switzerland.",
    "The recipe needs two eggs and a cup of flour.", "A satellite orbits the earth every ninety minutes.",
]
PROMPT = "The capital of France is"
N_NEW = 24
