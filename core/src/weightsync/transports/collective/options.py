"""What users set for transport `collective`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

LAYOUTS = ("safetensors", "flat", "flat_per_dtype")


class CollectiveOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    master_address: str = Field("127.0.0.1", description="address engines reach the trainer's store at")
    master_port: int = Field(0, ge=0, le=65535, description="store port; 0 picks a free one")
    group_name: str = Field("weightsync", min_length=1, description="prefix of the group's name")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: nccl when CUDA is available, else gloo")
    timeout: float = Field(120.0, gt=0, description="seconds a join or one broadcast may take")
    buffers: int = Field(2, ge=1, le=8, description="send buffers used in turn: the exporter "
                                                    "fills one while the other is broadcast")
