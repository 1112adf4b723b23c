"""The device side of a step: the packed forward pass (`ModelRunner`) and the paged K/V pools it
writes and reads (key calibration, the disk tier's store), and a hybrid model's recurrent states
and their prefix checkpoints (state_cache.py); never core's scheduling or the engine.
May import: `attention`, `models`, `core.sequence`."""
