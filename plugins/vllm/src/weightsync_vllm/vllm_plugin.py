"""vLLM general plugin (entry point group `vllm.general_plugins`): registers the `weightsync`
weight-transfer backend in every vLLM process. vLLM may call it several times per process, and
the factory refuses a second registration, so the registry is checked first."""

from __future__ import annotations

BACKEND = "weightsync"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    if BACKEND not in WeightTransferEngineFactory._registry:
        # lazy form: the backend module (and weightsync's receivers) load only in a worker that
        # was started with --weight-transfer-config '{"backend": "weightsync"}'
        WeightTransferEngineFactory.register_engine(BACKEND, "weightsync_vllm.backend",
                                                    "WeightSyncTransferEngine")
    # vLLM 0.32 on CPU skips the MoE expert prepack on weight updates (see cpu_moe): fix it in
    # every vLLM process, as soon as the module it patches is imported
    from .cpu_moe import install
    install()
