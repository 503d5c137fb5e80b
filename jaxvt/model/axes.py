"""The mesh axes the model's collectives name.

A model runs on a mesh of devices with two axes, "ep" (major) and "tp" (minor): attention heads,
FFN and shared-expert hidden units, DeltaNet heads and the output head's vocab rows split over
"tp"; routed experts split over ("ep", "tp") together.
"""

TP = "tp"
EP = "ep"
AXES = (EP, TP)  # mesh axis order; experts split over both, in this order
