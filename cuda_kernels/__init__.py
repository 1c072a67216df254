"""Level 5: hand-written CUDA kernels and their C++ CPU twins, registered as ``torch.ops.cuda_kernels``.

Importing this package is cheap: it builds nothing. ``cuda_kernels.ops`` compiles (the first time) and
loads the extension, and holds the functions the levels call. ``cuda_kernels.limits`` holds the facts
the rest of the project needs without building anything: the error a level raises when it cannot
run here, and the attention kernels' supported head dims; ``cuda_kernels.host_copy`` the way a few
numbers reach the host without stopping it (level 4's ops and the GPT use it too).
"""
