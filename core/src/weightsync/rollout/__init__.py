"""Rollouts for RL: sampled tokens with their logprobs and weight versions, from any engine of a
fleet (`RolloutClient`), or through one URL for the whole fleet (`RolloutRouter`)."""

from .types import Gate, NotFitting, Sample, SamplingParams, StaleEngines, Unsupported

__all__ = ["Gate", "NotFitting", "Sample", "SamplingParams", "StaleEngines", "Unsupported",
           "RolloutClient", "RolloutRouter"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: the client pulls in the plugin manager
    if name == "RolloutClient":
        from .client import RolloutClient
        return RolloutClient
    if name == "RolloutRouter":
        from .router import RolloutRouter
        return RolloutRouter
    raise AttributeError(name)
