"""Job specs: YAML files whose keys are the long option names of a command, and the bounds their values meet.

No torch here: the CLI reads these at load.
"""

# The largest size or count a job may give (a flag or its YAML key): the kernels and the scale grids index rows,
# inputs and blocks with 32-bit integers, and the bound also keeps a value that would overflow a C int from
# reaching torch.
INT32_MAX = 2**31 - 1
