"""Keys of the annotations that collectives leave on graph nodes for the compiler to read."""

LEAF_PATH = "fddp_leaf"  # the tree path of the leaf a per-leaf collective reduces
AXIS_INDEX = "fddp_axis_index"  # a value that differs per rank by construction (the rank)
BUCKET = "fddp_bucket"  # the index of the bucket a node belongs to
BUCKET_LEAVES = "fddp_leaves"  # on a bucket's launch: the paths of the leaves it holds
PARAM_GATHER = "fddp_param_gather"  # "argument.bucket" of the nodes that gather sharded parameters
PARAM_GATHER_KEPT = "fddp_param_gather_kept"  # the gathered bucket is kept for the whole step
FORWARD = "fddp_forward"  # emitted by the function a gradient differentiates (not its backward)
REMAT_REGION = "fddp_remat"  # (call token, its policy's fields or None): a fddp.remat region
REMAT_BLOCK = "fddp_remat_block"  # call token of a repeated block: a region of the step's policy
REMAT_NAME = "fddp_remat_name"  # on the marker fddp.remat_name leaves: the value's name
REMAT_RECOMPUTED = "fddp_remat_recomputed"  # a node recomputed in the backward: its region
EXACT_SUM = "fddp_exact_sum"  # the invariant mode's reduction of a leaf up to its sum's all-reduce
