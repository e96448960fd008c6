"""The sampler interface: what RL needs from an engine to generate rollouts, apart from the
round protocol that puts weights there (`Adapter`). Engine plugins implement it for their engine
and register a factory through RL's hook `register_samplers`; they need not import this module
(the Protocol is structural), so they depend on core alone."""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from weightsync.errors import PluginError
from weightsync.interfaces import Adapter
from weightsync.interfaces.sampling import Gate, Sample, SamplingParams, Unsupported

__all__ = ["Sampler", "sampler_for", "samplers"]


@runtime_checkable
class Sampler(Protocol):
    """Generates on one engine."""

    sampling: frozenset[str]
    """The `SamplingParams` fields the engine honours; the client refuses others before sending."""
    gates: bool
    """True when `generate` waits on the engine itself for a version the gate admits (and
    refuses exact requests whose weights move); False: the client reads the version around it."""

    def generate(self, prompt: list[int], params: SamplingParams, gate: Gate) -> list[Sample]:
        """`params.n` samples of `prompt`, each with the logprob of every sampled token and the
        version(s) it was computed with. Raises NotFitting (with the version held) when the
        engine holds no version `gate` admits, or when its weights changed under a request it
        cannot report per token."""

    def weight_version(self) -> int | None:
        """The version the engine serves now; None when it does not answer (or serves no gated
        request, after a failed probe)."""

    def busy_seconds(self) -> float | None:
        """Seconds the engine has spent generating since it started; None: not reported."""


def samplers(components: Any) -> dict[str, Callable[[Adapter], Any]]:
    """Every registered sampler factory, by adapter name (RL's hook over the components'
    plugin manager)."""
    found: dict[str, Callable[[Adapter], Any]] = {}

    def register(adapter: str, factory: Callable[[Adapter], Any]) -> None:
        if adapter in found and found[adapter] is not factory:
            raise PluginError(f"two samplers are registered for adapter {adapter!r}")
        found[adapter] = factory

    hook = getattr(components.pm.hook, "register_samplers", None)
    if hook is not None:
        hook(register=register)
    return found


def sampler_for(adapter: Adapter, components: Any) -> Sampler:
    """The sampler of `adapter`'s engine; Unsupported when its plugin registers none."""
    factory = samplers(components).get(adapter.name)
    if factory is None:
        raise Unsupported(f"adapter {adapter.name!r} cannot generate rollouts: no installed "
                          f"plugin registers a sampler for it (register_samplers)")
    sampler = factory(adapter)
    if not isinstance(sampler, Sampler):
        raise PluginError(f"the sampler registered for adapter {adapter.name!r} lacks members of "
                          f"weightsync_rl.rollout.Sampler")
    return sampler
