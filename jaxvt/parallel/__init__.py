"""Where a model runs: a mesh of devices (one device is the 1 x 1 mesh).

  mesh.py   `--mesh tp=N,ep=M` -> MeshSpec -> a `jax.sharding.Mesh` over the local devices
            (axes "ep" x "tp"); `jax.distributed.initialize` when several hosts are configured;
            `Par`, the static description the jitted functions and the model's collectives see,
            and `layout`, which builds it.

How each weight, the decode state and the forward split over the mesh is the model's
(jaxvt.model.sharding); the loader places the shards (jaxvt.loader).
"""
