"""Checkpoints at any model size: every rank saves and loads its own shards, nothing relays them.

- layout: names, the manifest, the job's identity, which files a rank reads to load.
- staging: the DeepSpeed checkpoint engine that writes a rank's files from the live state,
  beside training, computing their CRC-32s as it writes.
- tiers: each node's memory tier (private, stamped with the job) and the durable tier.
- actors: NodeStore, one per node: its memory tier, peer copies, serving files to other nodes.
- loading: a rank finds each file in the nearest good copy; DeepSpeed reads through its plan.
- reshard: a new world's partitions from the old one's, per rank, reading only what overlaps.
- manager: the driver's Checkpointer: save, commit (manifests only), upload, choose what to load.
- storage: the durable tier's filesystem (local, NFS, or any pyarrow URI).
"""
