"""Local kernel repositories in the `kernels` library's layout, and the kernel mapping."""
