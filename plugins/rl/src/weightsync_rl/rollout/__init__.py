"""Rollouts for RL: sampled tokens with their logprobs and weight versions, from any engine of a
fleet (`RolloutClient`), or through one URL for the whole fleet (`RolloutRouter`, `RouterClient`);
what an engine plugin implements to generate them (`Sampler`, registered by `register_samplers`).
The data they carry (`SamplingParams`, `Gate`, `Sample`) is `weightsync.interfaces.sampling`."""

from weightsync.interfaces.sampling import (Gate, NotFitting, Sample, SamplingParams, StaleEngines,
                                            Unsupported)
from weightsync_rl.rollout.client import Cancelled, RolloutClient
from weightsync_rl.rollout.remote import RouterClient
from weightsync_rl.rollout.router import RolloutRouter
from weightsync_rl.rollout.sampler import Sampler, sampler_for, samplers

__all__ = ["Cancelled", "Gate", "NotFitting", "RolloutClient", "RolloutRouter", "RouterClient", "Sample",
           "Sampler", "SamplingParams", "StaleEngines", "Unsupported", "sampler_for", "samplers"]
