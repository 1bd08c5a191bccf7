"""Engine plugins: each imports its own engine lazily and nothing of the other."""
