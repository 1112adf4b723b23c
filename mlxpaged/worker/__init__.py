"""The device side of a step: the packed forward pass (`ModelRunner`) and the paged K/V pools it
writes and reads (float or quantized rows, key calibration). May import attention and models;
never core's scheduling or the engine."""
