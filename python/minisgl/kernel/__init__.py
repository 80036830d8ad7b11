"""Small ops; `torch_ops` holds the pure-PyTorch versions."""
