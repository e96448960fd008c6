"""The reference engine: a real HTTP server that serves a causal LM and receives weights with
weightsync's full control protocol (`weightsync serve`), its adapter (`reference`), the engine
processes tests and the bench start, and the contracts that push through them. The reference
receiver for anyone wiring weightsync into their own engine. Its own distribution
(`weightsync-reference`): core never imports it."""

__version__ = "0.2.0"   # the one source: hatch reads it for the distribution's version
