"""Moving bytes and configs: safetensors headers and tensors, sharded writing, configs, GGUF.

Nothing here quantizes or converts; nothing here prints.
"""
