"""Launch the experiments on a Cloud TPU slice (tpu.py) or a multi-GPU machine (gpu.py)."""
