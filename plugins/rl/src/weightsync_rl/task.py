"""The demo's task, scored by plain code: after a start token and a digit `a`, count on,
a+1, a+2, ... (mod 10). The reward is the fraction of the first `length` completion tokens that
are right, so a policy earns partial credit and GRPO has a signal from the first step (a random
policy over the 16-token vocabulary scores about 1/16)."""

from __future__ import annotations

import random
from dataclasses import dataclass

BOS = 1
DIGIT0 = 2                       # digits 0..9 are token ids 2..11
VOCAB = 16


@dataclass
class CountingTask:
    length: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def prompts(self, count: int) -> list[list[int]]:
        return [[BOS, DIGIT0 + self.rng.randrange(10)] for _ in range(count)]

    def target(self, prompt: list[int]) -> list[int]:
        a = prompt[-1] - DIGIT0
        return [DIGIT0 + (a + i + 1) % 10 for i in range(self.length)]

    def reward(self, prompt: list[int], completion: list[int]) -> float:
        want = self.target(prompt)
        return sum(int(x == y) for x, y in zip(completion, want)) / self.length
