"""The router: unit tests and in front of real servers."""
