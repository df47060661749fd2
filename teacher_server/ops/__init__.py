"""Custom operators (CUDA kernels with torch references)."""
