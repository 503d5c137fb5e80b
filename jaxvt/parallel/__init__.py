"""Several devices: tensor and expert parallelism with jax.sharding.

  mesh.py   `--mesh tp=N,ep=M` -> MeshSpec -> a `jax.sharding.Mesh` over the local devices
            (axes "ep" x "tp"); `jax.distributed.initialize` when several hosts are configured;
            `Par`, the static description the jitted functions and the model's collectives see.
  shard.py  one sharding rule per declared weight (by its role and canonical name): which axis
            of a layer's matrix splits over which mesh axes, and the per-device shard shapes and
            bytes the planner budgets; the per-device model config; the shard_map'ed forward.
  load.py   places each weight's per-device shards (device tier or each shard's own pinned
            host buffers) as global arrays over the mesh.

Nothing here is imported by `import jaxvt`; an engine without `mesh` never touches it.
"""
