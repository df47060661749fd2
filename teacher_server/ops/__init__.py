"""Custom operators: ``extension`` builds and loads the CUDA kernels of ``kernels/`` once;
one file per op holds the op, its torch reference and its start-up check; ``fused`` holds
the stage functions a layer calls and the switches between kernels, compiled and eager."""
