"""Push a checkpoint into the engines of a sync config twice, changing every float each time."""

import sys

from safetensors.torch import load_file

from weightsync import WeightSync

config, checkpoint = sys.argv[1], sys.argv[2]
weights = load_file(checkpoint)
with WeightSync.from_config(config) as sync:
    for version in (1, 2):
        weights = {n: t + 1 if t.is_floating_point() else t for n, t in weights.items()}
        print(sync.push(weights, version=version).summary())
