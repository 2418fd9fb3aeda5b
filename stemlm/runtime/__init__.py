"""The machine: compute devices, GEMM backends, the allocator, pinned offline artifacts."""
