"""Where a model runs: a mesh of devices (one device is the 1 x 1 mesh).

  mesh.py   `--mesh tp=N,ep=M` -> MeshSpec -> a `jax.sharding.Mesh` over the local devices
            (axes "ep" x "tp"); `Par`, the static description the jitted functions and the
            model's collectives see, and `layout`, which builds it.
  processes.py  several processes (hosts): JAX's distributed runtime joined with bounded waits,
            the same model and flags checked in every process, all stopped when one fails.
  voice.py  only process 0 writes to the user.
  follow.py the server over several processes: process 0's decisions broadcast before each
            device program, the others run the same programs.

How each weight, the decode state and the forward split over the mesh is the model's
(jaxvt.model.sharding); the loader places the shards (jaxvt.loader).
"""
