"""The trainer's push: `WeightSync` (the pipeline), its assembly from a config, the check of a
config, the rounds over a group of engines, the data path of one round (stream), peer join inside
a push, the probe, the report and its metrics."""
