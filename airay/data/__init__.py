"""The data layer, one file per part:

- layout: which samples each global step trains on, and each rank's and micro-batch's share
  (the world's BatchPlan); pure, numpy only.
- parquet: parquet files as a row-addressable dataset (footers only until rows are read).
- prepare: the checks on a dataset before any actor starts; what the pipeline will stream.
- readers: what Ray Data's reader actors run to build a window of rows.
- pipeline: the driver's Feeder: a Ray Data pipeline cut into global steps of block references.
- source: the worker's side: its rank's micro-batches, synthetic or fetched from the blocks.

Nothing is imported here: reader actors import only what they use.
"""
