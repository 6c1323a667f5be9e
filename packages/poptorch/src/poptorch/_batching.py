"""Batching exactly as PopTorch: split each input over the micro-batches of a call, combine the outputs.

An input's dim 0 holds ``mb x DI x R x GA`` samples laid out as [DI, GA, R, mb] (device iteration
outermost, then accumulation, then replica), like PopART's data streams. Outputs of every micro-batch
run come back in the same layout and are reduced per OutputMode.
"""

import numpy as np

from poptorch.enums import OutputMode
from poptorch.errors import Error


class Layout:
    """Micro-batches of one call: DI device iterations x GA accumulated x R replicas."""

    def __init__(self, options, training):
        self.di = options.device_iterations
        self.ga = options.Training.gradient_accumulation if training else 1
        self.r = options.replication_factor
        # Replicas of one input group share a micro-batch (Options.inputReplicaGrouping).
        self.groups = np.asarray(options.input_replica_groups)
        self.ri = options.input_replication_factor
        mode = options.output_mode
        if mode == OutputMode.Default:
            mode = OutputMode.Final if training else OutputMode.All
        self.mode = mode
        self.period = options.output_return_period
        if mode == OutputMode.EveryN and (self.di * self.ga) % self.period:
            raise Error(
                f"OutputMode.EveryN({self.period}) needs a period dividing the "
                f"{self.di * self.ga} iterations of each call"
            )

    @property
    def count(self):
        """Micro-batches per call."""
        return self.di * self.ga * self.r

    def micro_batches(self):
        """(device iteration, accumulation step, replica) of each micro-batch run, in execution order."""
        return [(d, a, r) for d in range(self.di) for a in range(self.ga) for r in range(self.r)]

    @property
    def input_count(self):
        """Micro-batches a call's inputs hold (replicas of one input group share theirs)."""
        return self.di * self.ga * self.ri

    def split(self, name, array):
        """``array`` viewed as [DI, GA, R, mb, ...]; 0-d inputs are shared by every micro-batch."""
        if array.ndim == 0:
            return np.broadcast_to(array, (self.di, self.ga, self.r))
        n, count = array.shape[0], self.input_count
        if n % count:
            replicas = f"Options.replicationFactor({self.r})"
            if self.ri != self.r:
                replicas = f"{replicas} / inputReplicaGrouping size({self.r // self.ri})"
            raise Error(
                f"Invalid batch dimension: In the input {name}, the batch dimension ({n}) must be a multiple "
                f"of Options.deviceIterations({self.di}) * {replicas} * "
                f"Options.Training.gradientAccumulation({self.ga}) = {count}"
            )
        grouped = array.reshape(self.di, self.ga, self.ri, n // count, *array.shape[1:])
        return grouped if self.ri == self.r else grouped[:, :, self.groups]

    def micro_batch_shape(self, array):
        """The shape one micro-batch of ``array`` has (what the model is captured on)."""
        if array.ndim == 0:
            return tuple(array.shape)
        return (array.shape[0] // self.input_count, *array.shape[1:])

    def combine(self, per_run):
        """Outputs of every run ([DI*GA*R] arrays of one output, in run order) reduced per the OutputMode."""
        stacked = np.stack(per_run).reshape(self.di * self.ga, self.r, *per_run[0].shape)
        scalar = per_run[0].ndim == 0
        if self.mode == OutputMode.All:
            picked = stacked
        elif self.mode == OutputMode.EveryN:
            picked = stacked[self.period - 1 :: self.period]
        elif self.mode == OutputMode.Final:
            picked = stacked[-1:]
        else:
            picked = stacked.sum(axis=0, keepdims=True).astype(stacked.dtype)
        if self.mode in (OutputMode.Final, OutputMode.Sum) and self.r == 1:
            return picked[0, 0]
        if scalar:
            # One run per call returns a 0-d result as eager does (a loss, x.sum()); several runs stack.
            return picked.reshape(()) if self.count == 1 else picked.reshape(-1)
        return picked.reshape(-1, *per_run[0].shape[1:])

    def all_runs(self, per_run):
        """Every run's value concatenated in input layout (for in-place updates of inputs)."""
        if per_run[0].ndim == 0:
            return per_run[-1]
        if self.ri != self.r:
            # One value per input group: its first replica's.
            firsts = [list(self.groups).index(g) for g in range(self.ri)]
            per_run = [run for i, run in enumerate(per_run) if i % self.r in firsts]
        return np.concatenate(per_run, axis=0)
