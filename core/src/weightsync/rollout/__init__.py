"""Rollouts for RL: sampled tokens with their logprobs and weight versions, from any engine of a
fleet (`RolloutClient`), or through one URL for the whole fleet (`RolloutRouter`, `RouterClient`).
The data they carry (`SamplingParams`, `Gate`, `Sample`) is `weightsync.sampling`."""

from ..sampling import Gate, NotFitting, Sample, SamplingParams, StaleEngines, Unsupported
from .client import RolloutClient
from .remote import RouterClient
from .router import RolloutRouter

__all__ = ["Gate", "NotFitting", "RolloutClient", "RolloutRouter", "RouterClient", "Sample",
           "SamplingParams", "StaleEngines", "Unsupported"]
