"""The prompts every real-server PD test sends (SGLang's and vLLM's): 6 of 5..700 tokens (byte ids
below 256) one after another, and 16 more for the concurrent cases; each answer is NEW_TOKENS
greedy tokens."""

from __future__ import annotations

PROMPTS = [
    [104, 101, 108, 108, 111],
    list(range(32, 120)),
    [7, 1, 5] * 40,
    list(range(40, 250)) * 2,
    [(i * 37) % 251 for i in range(700)],
    [65] * 33,
]
CONCURRENT = [[(i * 13 + j * 7) % 250 + 1 for j in range(20 + 9 * i)] for i in range(16)]
NEW_TOKENS = 12
