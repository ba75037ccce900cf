"""`qtool select`: which kernel each layer of a checkpoint, a named model or bare K,N shapes gets on a device.

plan.py turns the source into layer groups and asks the pure `qtool.kernels.select.select_kernel` for each.
"""
