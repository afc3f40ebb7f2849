"""GPU: `gpu-check`, the engine on a CUDA device: correctness, kernels, roofline."""
