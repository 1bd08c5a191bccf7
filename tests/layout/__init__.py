"""The layout core: KV layouts, copy plans, repack, the cross-engine compatibility matrix."""
