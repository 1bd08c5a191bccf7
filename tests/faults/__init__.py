"""The fault matrix: kills and link cuts, two hosts in network namespaces."""
